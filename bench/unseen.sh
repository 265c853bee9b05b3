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
params["evaluate"].update({"sets": [{"name": "unseen", "source": "bench/prompts/unseen.jsonl", "num_prompts": 24,
                                     "headline": True}], "backend": sys.argv[2:]})
yaml.safe_dump(params, open(sys.argv[1], "w"), sort_keys=False)
PY
PATH="$PWD/.venv/bin:$PATH" python stages/evaluate.py --params "$out/params.yaml" --verifier models/verifier \
  --prepared data/prepared --draft models/draft --ngram metrics/free_sweep.json --metrics "$out/eval.json" \
  --out "$out/eval"
cat "$out/eval.json"
