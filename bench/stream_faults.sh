#!/usr/bin/env bash
# Benchmark (run by hand, in a checkout where `make demo` has run): the demo's draft trained from streamed hidden
# states, with faults. Runs `dvc exp run -S extract.store=stream`, SIGKILLs the trainer's first engine process at
# step ENGINE_KILL_STEP and the trainer itself at step TRAINER_KILL_STEP (after a checkpoint: train.checkpoint_every),
# then `dvc repro`, which resumes training from the checkpoint; prints what data/hidden_states holds and the draft's
# md5 against the one HEAD's dvc.lock records. The workspace is left as the run leaves it: restore it with
#   git checkout HEAD -- dvc.lock params.yaml metrics && dvc checkout
#
#   bench/stream_faults.sh [ENGINE_KILL_STEP [TRAINER_KILL_STEP]]     (defaults 150 and 450)
set -u
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
engine_kill_step=${1:-150}
trainer_kill_step=${2:-450}
log=$(mktemp -t stream-faults.XXXXXX.log)
steps=$(python -c 'import yaml; print(yaml.safe_load(open("params.yaml"))["train"]["steps"])')
draft_md5() { python -c 'import sys, yaml; lock = yaml.safe_load(sys.stdin)
print(next(o["md5"] for o in lock["stages"]["train"]["outs"] if o["path"] == "models/draft"))'; }
# The last "optimizer steps" progress line's step (the progress lines end in carriage returns).
step() { tr '\r' '\n' <"$log" | grep 'optimizer steps' | grep -o -E " [0-9]+/$steps " | tail -1 | tr -d ' ' | cut -d/ -f1; }

echo "dvc exp run -S extract.store=stream (log: $log)"
began=$(date +%s)
dvc exp run -S extract.store=stream >"$log" 2>&1 &
dvc_pid=$!
engine_killed=0
while kill -0 "$dvc_pid" 2>/dev/null; do
  now=$(step)
  now=${now:-0}
  trainer=$(pgrep -f "stages/train.py" | head -1)
  if [ "$engine_killed" = 0 ] && [ "$now" -ge "$engine_kill_step" ] && [ -n "$trainer" ]; then
    engine=$(pgrep -P "$trainer" -f spawn_main | head -1)
    echo "step $now: SIGKILL engine process $engine"
    kill -9 "$engine"
    engine_killed=1
  fi
  if [ "$engine_killed" = 1 ] && [ "$now" -ge "$trainer_kill_step" ] && [ -n "$trainer" ]; then
    echo "step $now: SIGKILL trainer $trainer"
    kill -9 "$trainer"
    break
  fi
  sleep 2
done
wait "$dvc_pid"
echo "dvc exp run exited $? after $(($(date +%s) - began)) s"
sleep 2
echo "engine processes left: $(pgrep -f spawn_main | wc -l)"
echo "data/hidden_states holds: $(ls data/hidden_states) ($(du -sb data/hidden_states | cut -f1) bytes with the folder)"
began=$(date +%s)
dvc repro >>"$log" 2>&1
echo "dvc repro exited $? after $(($(date +%s) - began)) s"
grep -E "resuming run|didn't change" "$log" | tail -6
echo "draft:              $(draft_md5 <dvc.lock)"
echo "HEAD's dvc.lock:    $(git show HEAD:dvc.lock | draft_md5)"
