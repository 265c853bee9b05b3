"""The seed-to-seed spread of the headline figures: the same pipeline retrained with other ``train.seed`` values.

Run in a checkout whose pipeline is up to date (``make demo`` done), with the project's interpreter on PATH::

    .venv/bin/python bench/seed_spread.py --seeds 1 2

Seed 0 is the checkout's own result (``metrics/eval.json``); every other seed is one ``dvc exp run -S
train.seed=N`` (train and evaluate re-run; prepare, extract and convert are cached). Writes
``docs/seed-spread.json`` (``--out``): per headline set (every one metrics/eval.json holds, ``long`` included) and
figure, the value of each seed by seed and their range (max - min) where at least two seeds gave it, which
``eaglenest report`` takes as the smallest change it calls better or worse; and the host kind the runs share (from
metrics/eval/details.json), since a spread measured on one kind says nothing of another.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from eaglenest.core.atomic import atomic_write_json

OUT = Path("docs/seed-spread.json")


def read_json(path: str, revision: str | None = None) -> dict:
    """A tracked JSON file of the workspace or of a revision."""
    if revision is None:
        return json.loads(Path(path).read_text())
    shown = subprocess.run(["git", "show", f"{revision}:{path}"], capture_output=True, text=True, check=True)
    return json.loads(shown.stdout)


def headline(revision: str | None = None) -> dict:
    return read_json("metrics/eval.json", revision)


def host(revision: str | None = None) -> dict | None:
    """The host kind evaluate recorded (metrics/eval/details.json), or None where it recorded none."""
    recorded = read_json("metrics/eval/details.json", revision).get("host")
    return recorded if isinstance(recorded, dict) else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="train.seed values besides 0")
    parser.add_argument(
        "--revisions",
        nargs="+",
        metavar="SEED=REV",
        help="read finished runs instead of running: train.seed=REV pairs (0 included)",
    )
    parser.add_argument(
        "--figures",
        nargs="+",
        metavar="NAME[=SEED,...]",
        help="record only these figures (vllm_tau, ...), each from every seed or from the seeds "
        "listed (vllm_speedup=0,2): a speed-up timed beside other work is not a seed's spread",
    )
    parser.add_argument("--out", type=Path, default=OUT, help=f"the file to write (default: {OUT})")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    hosts: dict[int, dict | None] = {}
    if args.revisions:
        pairs = [pair.split("=", 1) for pair in args.revisions]
        runs = {int(seed): headline(rev) for seed, rev in pairs}
        hosts = {int(seed): host(rev) for seed, rev in pairs}
    else:
        runs, hosts = {0: headline()}, {0: host()}
        for seed in args.seeds:
            print(f"seed {seed}: dvc exp run -S train.seed={seed}", flush=True)
            subprocess.run(["dvc", "exp", "run", "-S", f"train.seed={seed}"], check=True)
            runs[seed], hosts[seed] = headline(), host()
    keys = {seed: (kind or {}).get("key") for seed, kind in hosts.items()}
    if len(set(keys.values())) != 1 or None in keys.values():
        raise SystemExit(f"bench/seed_spread.py: the runs must share one recorded host kind; got {keys}")
    # figure -> the seeds it is read from (None: every seed)
    wanted: dict[str, set[int] | None] = {}
    for spec in args.figures or []:
        name, _, seeds = spec.partition("=")
        wanted[name] = {int(seed) for seed in seeds.split(",")} if seeds else None
    values: dict[str, dict[str, dict[str, float]]] = {}  # set -> figure -> seed -> value
    for seed, figures in sorted(runs.items()):
        for set_name, entry in figures.items():
            if isinstance(entry, dict):
                for metric, value in entry.items():
                    if metric.endswith("_ci95") or (wanted and metric not in wanted):
                        continue
                    if wanted and wanted[metric] is not None and seed not in wanted[metric]:
                        continue
                    values.setdefault(set_name, {}).setdefault(metric, {})[str(seed)] = value
    atomic_write_json(
        args.out,
        {
            "what": "headline figures of the default pipeline retrained with each train.seed (prepare, extract and "
            "convert cached); values: per set and figure, each seed's value by seed, from the seeds --figures "
            "names for it; figures: max - min of a figure at least two seeds gave (none: no spread, no verdict)",
            "command": " ".join(["bench/seed_spread.py", *sys.argv[1:]]),
            "commit": commit,
            "seeds": sorted(runs),
            "host": hosts[min(hosts)],
            "values": values,
            "figures": {
                s: {m: round(max(v.values()) - min(v.values()), 4) for m, v in metrics.items() if len(v) >= 2}
                for s, metrics in values.items()
            },
        },
    )
    print(json.dumps(json.loads(args.out.read_text())["figures"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
