#!/usr/bin/env bash
# On a machine with one NVIDIA GPU, after `make setup VLLM=gpu`: the hf and vllm back ends agree on
# regeneration (float32, token for token), extraction (per layer slot, bf16 tolerance) and evaluation
# (float32 tau and acceptance within 1%). Under 10 minutes. Exits 2, saying why, on a machine without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
PY=${PYTHON:-python}
"$PY" -m eaglenest doctor
timeout 600 "$PY" scripts/gpu_check.py --rows 32 "$@"
