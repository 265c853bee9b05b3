#!/usr/bin/env bash
# What `eaglenest serve --record` costs the served path (run by hand, after `make demo`): the demo's draft served twice
# with the same flags, one server recording into a temporary folder and one not, compared by `eaglenest bench` at
# concurrency 1 and 16 (the recording server in the draft's seat, so its "speed-up" is recording's cost: x1.00 is
# none). Writes bench/results/record_overhead/ (bench.json, speedup.png) and prints the lines recorded.
#
#   bench/record_overhead.sh [ROUNDS] [NUM_PROMPTS]
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
rounds=${1:-3}
prompts=${2:-48}
record_dir=$(mktemp -d)
out=bench/results/record_overhead
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$record_dir"
}
trap cleanup EXIT

eaglenest serve --record "$record_dir/traffic" --port 8201 >"$record_dir/recording.log" 2>&1 &
pids+=($!)
eaglenest serve --port 8202 >"$record_dir/plain.log" 2>&1 &
pids+=($!)
for port in 8201 8202; do
  for _ in $(seq 1 150); do
    curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null && break
    sleep 2
  done
done
eaglenest bench --url http://127.0.0.1:8201 --baseline-url http://127.0.0.1:8202 --prompts builtin:general \
  --concurrency 1 16 --rounds "$rounds" --num-prompts "$prompts" --out "$out"
echo "lines recorded: $(cat "$record_dir"/traffic/traffic-*.jsonl | wc -l)"
