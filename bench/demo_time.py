"""Benchmark (run by hand): where `make demo`'s time goes, per stage and per phase, on this host kind.

    .venv/bin/python bench/demo_time.py --clone /tmp/demo-time [--keep] [--force] [--out bench/results/demo_time.json]
    bench/avx2_host.sh .venv/bin/python bench/demo_time.py --clone /tmp/demo-time-avx2   # as an AVX2-only CPU

Clones this repository (its committed HEAD) to ``--clone``, times ``make setup`` there, then runs the pipeline
one stage at a time (``dvc repro -s STAGE``, in the pipeline's order) so each stage's wall time is its own, and
``eaglenest summary``. Per stage it also keeps what the stage's metrics say of its own phases (prepare: prompts
and replies; extract and train: seconds and tokens/s; evaluate: each engine's start, its batched passes and the
timed turns, from ``metrics/eval/details.json``; k_sweep: each engine's start and each round's timed turns).
Writes one JSON record with the host kind (:func:`eaglenest.core.host.host_record`) and the commit, and prints a
table. Run it on an idle machine: the
figures are wall-clock.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def timed(cmd: list[str], cwd: Path, env: dict[str, str]) -> float:
    """Runs ``cmd`` (its output to this process's), raising on failure; returns its wall seconds."""
    started = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, env=env, check=True)
    return time.perf_counter() - started


def stage_phases(clone: Path, stage: str) -> dict:
    """What a stage's own metrics say of its phases (seconds and rates); empty where it records none."""

    def read(path: str) -> dict:
        file = clone / path
        return json.loads(file.read_text()) if file.is_file() else {}

    if stage == "prepare":
        m = read("metrics/prepare.json")
        return {
            k: m.get(k)
            for k in (
                "seconds",
                "prompts_written",
                "prompts_tried",
                "prompt_tokens_per_s",
                "regenerated_tokens",
                "regenerate_tokens_per_s",
            )
        }
    if stage == "extract":
        m = read("metrics/extract.json")
        return {k: m.get(k) for k in ("seconds", "tokens", "tokens_per_s")}
    if stage == "train":
        m = read("metrics/train_details.json")
        return {k: m.get(k) for k in ("seconds", "tokens_per_s", "precision", "steps")}
    if stage == "evaluate":
        details = read("metrics/eval/details.json")
        return {backend: run.get("phases", {}) for backend, run in details.get("runs", {}).items()}
    if stage == "k_sweep":
        return read("metrics/k_sweep.json").get("seconds", {})
    if stage == "free_sweep":
        return read("metrics/free_sweep.json").get("seconds", {})
    return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clone", type=Path, required=True, help="where to clone (must not exist, unless --reuse)")
    parser.add_argument("--reuse", action="store_true", help="time the stages in an existing clone (no setup)")
    parser.add_argument("--out", type=Path, default=None, help="the JSON record (default: print only)")
    parser.add_argument("--keep", action="store_true", help="keep the clone (it holds ~2 GB of outputs)")
    parser.add_argument(
        "--force",
        action="store_true",
        help="run every stage (dvc repro -f -s), also those whose "
        "outputs the clone reproduces bit for bit: the demo's time on a host kind other than the "
        "committed metrics'",
    )
    args = parser.parse_args()

    env = dict(os.environ)
    record: dict = {
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, check=True, capture_output=True, text=True
        ).stdout.strip(),
        "forced": args.force,
    }
    if not args.reuse:
        subprocess.run(["git", "clone", "-q", str(REPO), str(args.clone)], check=True)
        record["setup_s"] = round(timed(["make", "setup"], args.clone, env), 1)
    venv_bin = args.clone / ".venv" / "bin"
    env.update(
        PATH=f"{venv_bin}{os.pathsep}{env['PATH']}",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    stages = list(yaml.safe_load((args.clone / "dvc.yaml").read_text())["stages"])
    record["stages"] = {}
    for stage in stages:
        seconds = timed([str(venv_bin / "dvc"), "repro", *(["-f"] if args.force else []), "-s", stage], args.clone, env)
        record["stages"][stage] = {"seconds": round(seconds, 1), "phases": stage_phases(args.clone, stage)}
    record["demo_s"] = round(sum(s["seconds"] for s in record["stages"].values()), 1)
    summary = subprocess.run(
        [str(venv_bin / "eaglenest"), "summary"], cwd=args.clone, env=env, check=True, capture_output=True, text=True
    ).stdout
    record["summary"] = summary.splitlines()
    host = subprocess.run(
        [
            str(venv_bin / "python"),
            "-c",
            "import json; from eaglenest.core.host import host_record; print(json.dumps(host_record()))",
        ],
        cwd=args.clone,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    record["host"] = json.loads(host)
    print(summary)
    for stage, entry in record["stages"].items():
        print(f"{stage:10s} {entry['seconds']:8.1f} s  {json.dumps(entry['phases'])}")
    print(f"{'demo':10s} {record['demo_s']:8.1f} s (setup {record.get('setup_s', '-')} s) on {record['host']['key']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    if not args.keep and not args.reuse:
        shutil.rmtree(args.clone)


if __name__ == "__main__":
    sys.exit(main())
