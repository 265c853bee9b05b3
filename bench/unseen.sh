#!/usr/bin/env bash
# The held-out check of generalization: the current draft on bench/prompts/unseen.jsonl (kinds the project never
# tunes on), with the evaluate stage itself. Run in a checkout whose pipeline has run (`make demo`).
# Usage: bench/unseen.sh [BACKEND ...]   (default: hf vllm); figures land in bench/results/unseen/.
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results/unseen
mkdir -p "$out"
if [ $# -eq 0 ]; then set -- hf vllm; fi
PATH="$PWD/.venv/bin:$PATH" python - "$out/params.yaml" "$@" <<'PY'
import sys, yaml
params = yaml.safe_load(open("params.yaml"))
params["evaluate"].update({"prompts": "bench/prompts/unseen.jsonl", "general_prompts": None, "num_prompts": 24,
                           "backend": sys.argv[2:]})
yaml.safe_dump(params, open(sys.argv[1], "w"), sort_keys=False)
PY
PATH="$PWD/.venv/bin:$PATH" python stages/evaluate.py --params "$out/params.yaml" --verifier models/verifier \
  --prepared data/prepared --draft models/draft --metrics "$out/eval.json" --plots "$out/plots"
PATH="$PWD/.venv/bin:$PATH" python -c "import json; m = json.load(open('$out/eval.json')); print({k: v for k, v in m.items() if k.startswith(('tau', 'vllm_tau', 'speedup', 'vllm_speedup', 'lossless'))})"
