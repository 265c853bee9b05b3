"""How the 95% interval of tau narrows with the number of prompts, from the records of one evaluation.

Run in a checkout after ``dvc repro`` (it reads ``metrics/eval/records.json`` only)::

    .venv/bin/python bench/interval_width.py [--backend vllm] [--sizes 8 16 32 64 128 164]

For each set it takes the first n conversations and prints tau with its bootstrap half-width, the way the
evaluate stage computes it, so the default set sizes can be chosen for the interval a reviewer needs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from eaglenest.artifacts.evaluation import load_records, tau_interval

RECORDS = Path("metrics/eval/records.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="vllm")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128, 164])
    parser.add_argument("--samples", type=int, default=2000)
    args = parser.parse_args()
    document = load_records(RECORDS.read_text(), str(RECORDS))
    print("| set | prompts | tau | ± (95%) |\n|---|---|---|---|")
    for set_name, entry in document["runs"][args.backend]["sets"].items():
        records = entry["records"]
        order = list(dict.fromkeys(str(r["id"]) for r in records))
        for size in [n for n in args.sizes if n <= len(order)] or [len(order)]:
            keep = set(order[:size])
            interval = tau_interval([r for r in records if str(r["id"]) in keep], args.samples, 0)
            print(f"| {set_name} | {size} | {interval.value:.3f} | {interval.half_width:.3f} |")


if __name__ == "__main__":
    main()
