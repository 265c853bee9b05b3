#!/usr/bin/env bash
# On a machine with one GPU, after `pip install -e '.[vllm]'`: extract 32 rows of the default verifier with
# the hf and vllm back ends and compare them layer by layer (bf16 tolerance). Under 10 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
PY=${PYTHON:-python}
"$PY" -m eaglenest doctor
timeout 600 "$PY" scripts/gpu_check.py --rows 32 "$@"
