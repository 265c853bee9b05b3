#!/usr/bin/env bash
# The README's steps in a fresh clone, typed as a user types them, each step's visible result checked: make demo
# (its summary table, the files it writes, a clean dvc status), eaglenest doctor, eaglenest serve answering one
# chat request from an OpenAI client (with the draft's counters in /metrics), an experiment (dvc exp run -S),
# dvc exp show, dvc metrics diff, eaglenest report and eaglenest summary. It stops at the first step that fails,
# with one line naming the step and what was wrong; every step's output is kept in a log.
#
#   scripts/walkthrough.sh                          # clone this checkout's HEAD into a scratch folder, run it all
#   scripts/walkthrough.sh SOURCE                   # clone SOURCE (a path or URL) instead
#   WALKTHROUGH_CHECKOUT=DIR scripts/walkthrough.sh # reuse DIR, where make demo (or dvc repro) already ran:
#                                                   # no clone, no make demo; the later steps change DIR's workspace
#
# Settings (environment): WALKTHROUGH_DIR, the scratch folder (default: a new one under TMPDIR); WALKTHROUGH_VENV,
# the environment to activate (default: the checkout's .venv); WALKTHROUGH_PORT (8000); WALKTHROUGH_SERVE_TIMEOUT,
# seconds for the server to answer (900); WALKTHROUGH_RECORD, where the run's record goes (default:
# bench/results/walkthrough.json of the checkout this script is in). It takes the demo's time (16-50 minutes on
# 2 cores) plus an experiment's (train, evaluate and k_sweep again) and a server start: run it by hand or in a benchmark
# job, never in `make test`.
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SOURCE="${1:-$HERE}"
EXPERIMENT="lr-3e-4"           # the README's experiment, as Compare experiments types it
PORT="${WALKTHROUGH_PORT:-8000}"
SERVE_TIMEOUT="${WALKTHROUGH_SERVE_TIMEOUT:-900}"
RECORD="${WALKTHROUGH_RECORD:-$HERE/bench/results/walkthrough.json}"
SCRATCH="${WALKTHROUGH_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/walkthrough.XXXXXX")}"
LOGS="$SCRATCH/logs"
STEPS="$SCRATCH/steps.tsv"     # name, seconds, result, command: one line per step, for the record
SERVER_PID=""
mkdir -p "$LOGS" && : > "$STEPS"

if [ -n "${WALKTHROUGH_CHECKOUT:-}" ]; then
  CHECKOUT="$(cd "$WALKTHROUGH_CHECKOUT" && pwd)" || { echo "walkthrough: WALKTHROUGH_CHECKOUT=$WALKTHROUGH_CHECKOUT is not a folder"; exit 1; }
  ORIGIN="a checkout where the pipeline had run (clone and make demo skipped)"
else
  CHECKOUT="$SCRATCH/clone"
  ORIGIN="a fresh clone"
fi

write_record() {  # the run's record: what ran, where, how long each step took, and how it ended
  mkdir -p "$(dirname "$RECORD")"
  python3 - "$STEPS" "$RECORD" "$1" "$ORIGIN" "$CHECKOUT" <<'PY'
import json, os, subprocess, sys
steps_file, record, result, origin, checkout = sys.argv[1:]
steps = []
for line in open(steps_file):
    name, seconds, outcome, command = line.rstrip("\n").split("\t", 3)
    steps.append({"step": name, "command": command, "seconds": int(seconds), "result": outcome})
host = os.environ.get("WALKTHROUGH_HOST", "")
commit = subprocess.run(["git", "-C", checkout, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
document = {"result": result, "checkout": origin, "commit": commit or None, "host": host or None, "steps": steps}
tmp = record + ".tmp"
with open(tmp, "w") as handle:
    json.dump(document, handle, indent=2)
    handle.write("\n")
os.replace(tmp, record)
PY
}

stop_server() {
  [ -n "$SERVER_PID" ] || return 0
  kill -INT -- "-$SERVER_PID" 2>/dev/null
  for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
  kill -TERM -- "-$SERVER_PID" 2>/dev/null
  wait "$SERVER_PID" 2>/dev/null
  SERVER_PID=""
}

fail() {  # fail STEP WHAT: the one line, the record, and exit 1
  printf '%s\t%s\t%s\t%s\n' "$1" "${SECONDS_TAKEN:-0}" "failed: $2" "${COMMAND:-}" >> "$STEPS"
  stop_server
  write_record "failed at $1"
  echo "walkthrough: step '$1' failed: $2 (logs: $LOGS)"
  exit 1
}
trap 'stop_server' EXIT
trap 'fail "${CURRENT:-start}" "interrupted"' INT TERM

# step NAME COMMAND: runs COMMAND as typed, in the checkout, its output in the step's log; a non-zero exit fails it.
step() {
  CURRENT="$1" COMMAND="$2"
  LOG="$LOGS/$(printf '%02d' "$(($(wc -l < "$STEPS") + 1))")-$1.log"
  local start=$SECONDS status
  echo "walkthrough: $1: $COMMAND"
  (cd "$CHECKOUT" && printf '$ %s\n' "$COMMAND" && bash -c "$COMMAND") > "$LOG" 2>&1
  status=$?
  SECONDS_TAKEN=$((SECONDS - start))
  [ "$status" -eq 0 ] || fail "$1" "\`$COMMAND\` exited $status; the end of its output: $(tail -n 1 "$LOG")"
}
passed() {  # passed DETAIL: the step's checks held
  printf '%s\t%s\t%s\t%s\n' "$CURRENT" "$SECONDS_TAKEN" "ok${1:+: $1}" "$COMMAND" >> "$STEPS"
  echo "walkthrough: $CURRENT: ok${1:+ ($1)} in ${SECONDS_TAKEN} s"
}
need_file() { [ -s "$CHECKOUT/$1" ] || fail "$CURRENT" "$1 was not written"; }
need_output() { grep -Eq "$1" "$LOG" || fail "$CURRENT" "its output lacks $2"; }
headline_sets() { python3 -c 'import json,sys; print(" ".join(k for k, v in json.load(open(sys.argv[1])).items() if isinstance(v, dict)))' "$CHECKOUT/metrics/eval.json"; }
summary_table() {  # checks the summary's table in the step's output: header, a row per headline set, lossless 1.0
  need_output '^set +[a-z]+ tau \(95%\) +speed-up \(95%\) +n-gram speed-up \(95%\)' "the summary's table header"
  for set in $(headline_sets); do need_output "^$set +[0-9.]+ ± [0-9.]+ +x[0-9.]+" "the summary's row for set $set"; done
  need_output '^lossless: 1\.0$' "lossless: 1.0 (greedy output equal to plain decoding)"
  need_output '^served K: [0-9]+ \(measured for this draft by the k_sweep stage: x[0-9.]+ ± [0-9.]+ on ' \
    "the served K, measured for this draft by the k_sweep stage"
}

# --- Quickstart -------------------------------------------------------------------------------------------------
if [ -z "${WALKTHROUGH_CHECKOUT:-}" ]; then
  # the record names no folder of this machine: the clone's commit says what was cloned
  CURRENT=clone COMMAND="git clone SOURCE CLONE" LOG="$LOGS/00-clone.log" SECONDS_TAKEN=0
  git clone -q "$SOURCE" "$CHECKOUT" > "$LOG" 2>&1 || fail clone "git clone $SOURCE exited $? ($(tail -n 1 "$LOG"))"
  passed "$(git -C "$CHECKOUT" rev-parse --short HEAD)"

  step demo "make demo"
  for file in models/verifier/config.json models/draft/config.json models/draft/model.safetensors dvc.lock \
              metrics/eval.json metrics/train.json metrics/eval/details.json metrics/k_sweep.json; do
    need_file "$file"
  done
  summary_table
  passed "$(headline_sets | wc -w) headline sets, lossless 1.0"
fi

VENV="${WALKTHROUGH_VENV:-$CHECKOUT/.venv}"
[ -f "$VENV/bin/activate" ] || fail activate "$VENV/bin/activate does not exist (make setup creates it)"
# shellcheck disable=SC1091
source "$VENV/bin/activate"
export WALKTHROUGH_HOST="$(cd "$CHECKOUT" && python -c 'from eaglenest.core.host import host_kind; print(host_kind().label)' 2>/dev/null)"

step status "dvc status"
need_output 'Data and pipelines are up to date' "\"Data and pipelines are up to date\" (the demo's outputs match dvc.lock)"
passed

# --- Install ----------------------------------------------------------------------------------------------------
# the README types the venv's path; a reused checkout's environment may live elsewhere (WALKTHROUGH_VENV)
if [ -x "$CHECKOUT/.venv/bin/eaglenest" ]; then step doctor ".venv/bin/eaglenest doctor"; else step doctor "eaglenest doctor"; fi
passed

# --- Serve the draft --------------------------------------------------------------------------------------------
CURRENT=serve COMMAND="eaglenest serve --port $PORT" LOG="$LOGS/$(printf '%02d' "$(($(wc -l < "$STEPS") + 1))")-serve.log"
echo "walkthrough: serve: $COMMAND, then one chat request from the OpenAI client"
start=$SECONDS
# setsid: the server leads its own process group (a background subshell of a script is no group leader, so setsid
# execs in place and keeps the pid), and stop_server signals that whole group: vLLM's engine processes too.
(cd "$CHECKOUT" && exec setsid eaglenest serve --port "$PORT") > "$LOG" 2>&1 &
SERVER_PID=$!
until python -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' \
      "http://127.0.0.1:$PORT/v1/models" 2> /dev/null; do
  SECONDS_TAKEN=$((SECONDS - start))
  kill -0 "$SERVER_PID" 2> /dev/null || fail serve "the server exited before it answered: $(tail -n 1 "$LOG")"
  [ "$SECONDS_TAKEN" -lt "$SERVE_TIMEOUT" ] || fail serve "/v1/models did not answer within $SERVE_TIMEOUT s"
  sleep 3
done
python - "$PORT" > "$LOGS/serve-client.log" 2>&1 <<'PY'
"""One chat completion at temperature 0 through the OpenAI client, then the draft's counters in /metrics."""
import sys
import urllib.request

from openai import OpenAI

base = f"http://127.0.0.1:{sys.argv[1]}"
client = OpenAI(base_url=f"{base}/v1", api_key="none")
model = client.models.list().data[0].id
reply = client.chat.completions.create(model=model, temperature=0, max_tokens=48, messages=[
    {"role": "user", "content": "Write a Python function that returns the sum of a list of numbers."}])
text = (reply.choices[0].message.content or "").strip()
if not text:
    sys.exit("the completion was empty")
counters = {}
for line in urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode().splitlines():
    for name in ("spec_decode_num_drafts_total", "spec_decode_num_accepted_tokens_total"):
        if line.startswith(f"vllm:{name}") and "position" not in line:
            counters[name] = counters.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
drafts = counters.get("spec_decode_num_drafts_total", 0.0)
if drafts <= 0:
    sys.exit("/metrics counts no drafts: the draft was not used")
tau = 1 + counters.get("spec_decode_num_accepted_tokens_total", 0.0) / drafts
print(f"model {model}; {reply.usage.completion_tokens} tokens; tau {tau:.3f} over {drafts:.0f} drafts")
print(f"completion: {text!r}")
PY
client_status=$?
SECONDS_TAKEN=$((SECONDS - start))
if [ "$client_status" -ne 0 ]; then
  fail serve "the client: $(tail -n 1 "$LOGS/serve-client.log"); the server's last line: $(tail -n 1 "$LOG")"
fi
stop_server
passed "$(head -n 1 "$LOGS/serve-client.log")"

# --- Compare experiments ----------------------------------------------------------------------------------------
BASE="$(git -C "$CHECKOUT" rev-parse --abbrev-ref HEAD)"  # main in a clone of main
if (cd "$CHECKOUT" && dvc exp list --name-only 2>/dev/null | grep -qx "$EXPERIMENT"); then
  CURRENT=experiment COMMAND="" SECONDS_TAKEN=0
  fail experiment "the checkout already has an experiment $EXPERIMENT (dvc exp remove $EXPERIMENT)"
fi
step experiment "dvc exp run -n $EXPERIMENT -S train.lr=3e-4"
need_output "Ran experiment\(s\): $EXPERIMENT" "\"Ran experiment(s): $EXPERIMENT\""
passed

step exp-show "dvc exp show --only-changed"
need_output "$EXPERIMENT" "the experiment $EXPERIMENT"
passed

step metrics-diff "dvc metrics diff $BASE"
need_output 'metrics/eval\.json +[a-z0-9_-]+\.[a-z]+_tau ' "a headline tau of metrics/eval.json"
passed

step report "eaglenest report $BASE $EXPERIMENT --out report"
need_file report/report.md
grep -q "$EXPERIMENT" "$CHECKOUT/report/report.md" || fail report "report/report.md does not name $EXPERIMENT"
ls "$CHECKOUT"/report/*.png > /dev/null 2>&1 || fail report "report/ holds no PNG plot"
passed "$(ls "$CHECKOUT"/report/*.png | wc -l) plots"

step summary "eaglenest summary"
summary_table
passed

write_record passed
echo "walkthrough: every step passed ($ORIGIN at $(git -C "$CHECKOUT" rev-parse --short HEAD)); record: $RECORD"
