"""The seed-to-seed spread of the headline figures: the same pipeline retrained with other ``train.seed`` values.

Run in a checkout whose pipeline is up to date (``make demo`` done), with the project's interpreter on PATH::

    .venv/bin/python bench/seed_spread.py --seeds 1 2

Seed 0 is the checkout's own result (``metrics/eval.json``); every other seed is one ``dvc exp run -S
train.seed=N`` (train and evaluate re-run; prepare, extract and convert are cached). Writes
``docs/seed-spread.json``: per headline set and figure, the values per seed and their range (max - min), which
``eaglenest report`` takes as the smallest change it calls better or worse.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from eaglenest.core.atomic import atomic_write_json

OUT = Path("docs/seed-spread.json")


def headline(revision: str | None = None) -> dict:
    if revision is None:
        return json.loads(Path("metrics/eval.json").read_text())
    shown = subprocess.run(["git", "show", f"{revision}:metrics/eval.json"], capture_output=True, text=True,
                           check=True)
    return json.loads(shown.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="train.seed values besides 0")
    parser.add_argument("--revisions", nargs="+", metavar="SEED=REV",
                        help="read finished runs instead of running: train.seed=REV pairs (0 included)")
    parser.add_argument("--figures", nargs="+", metavar="NAME[=SEED,...]",
                        help="record only these figures (vllm_tau, ...), each from every seed or from the seeds "
                        "listed (vllm_speedup=0,2): a speed-up timed beside other work is not a seed's spread")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    if args.revisions:
        runs = {int(seed): headline(rev) for seed, rev in (pair.split("=", 1) for pair in args.revisions)}
    else:
        runs = {0: headline()}
        for seed in args.seeds:
            print(f"seed {seed}: dvc exp run -S train.seed={seed}", flush=True)
            subprocess.run(["dvc", "exp", "run", "-S", f"train.seed={seed}"], check=True)
            runs[seed] = headline()
    # figure -> the seeds it is read from (None: every seed)
    wanted: dict[str, set[int] | None] = {}
    for spec in args.figures or []:
        name, _, seeds = spec.partition("=")
        wanted[name] = {int(seed) for seed in seeds.split(",")} if seeds else None
    values: dict[str, dict[str, list[float]]] = {}
    for seed, figures in sorted(runs.items()):
        for set_name, entry in figures.items():
            if isinstance(entry, dict):
                for metric, value in entry.items():
                    if metric.endswith("_ci95") or (wanted and metric not in wanted):
                        continue
                    if wanted and wanted[metric] is not None and seed not in wanted[metric]:
                        continue
                    values.setdefault(set_name, {}).setdefault(metric, []).append(value)
    atomic_write_json(OUT, {
        "what": "headline figures of the default pipeline retrained with each train.seed (prepare, extract and "
                "convert cached); values: per figure, in seed order, from the seeds --figures names for it; "
                "figures: max - min",
        "command": " ".join(["bench/seed_spread.py", *sys.argv[1:]]),
        "commit": commit,
        "seeds": sorted(runs),
        "values": values,
        "figures": {s: {m: round(max(v) - min(v), 4) for m, v in metrics.items()} for s, metrics in values.items()},
    })
    print(json.dumps(json.loads(OUT.read_text())["figures"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
