"""The ground every stage and command stands on: params, errors, atomic writes, registry, device,
chat helpers, the environment check, the stage contract, the verifier's decoder forward and vLLM support."""
