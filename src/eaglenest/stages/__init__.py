"""The pipeline's stages, one package each. A stage imports the ground, the artifacts and vLLM
support, never another stage, so its DVC dependencies are exactly its own code and what it reads."""
