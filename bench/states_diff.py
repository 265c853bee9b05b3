"""Benchmark (run by hand): how far apart two extractions' stored hidden states are, element by element.

    .venv/bin/python bench/states_diff.py --rev 7fbcdb7

compares the workspace's data/hidden_states with the one the commit REV's dvc.lock records, read from DVC's local
cache (run `dvc fetch` for that revision first where the cache lacks it); `--old DIR --new DIR` compares two
folders. Both must hold the same files (shards or row files) of the same rows. Prints, per file and tensor, the
share of elements that differ and the largest difference; then over all: the share, the largest difference and the
relative L2 distance (||old - new|| / ||old||). Token ids and the other integer tensors must be equal.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

CACHE = Path(".dvc/cache/files/md5")
OUTPUT = "data/hidden_states"


def cached_files(rev: str) -> dict[str, Path]:
    """The files of data/hidden_states as ``rev``'s dvc.lock records them, by name, in DVC's local cache."""
    lock = yaml.safe_load(subprocess.run(["git", "show", f"{rev}:dvc.lock"], check=True, capture_output=True).stdout)
    (md5,) = [out["md5"] for out in lock["stages"]["extract"]["outs"] if out["path"] == OUTPUT]
    listing = CACHE / md5[:2] / md5[2:]
    if not listing.exists():
        raise SystemExit(f"{listing}: not in DVC's cache; run `dvc fetch --rev {rev} extract` first")
    return {entry["relpath"]: CACHE / entry["md5"][:2] / entry["md5"][2:] for entry in json.loads(listing.read_text())}


def folder_files(folder: Path) -> dict[str, Path]:
    return {path.name: path for path in sorted(folder.glob("*.safetensors"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", help="the commit whose dvc.lock names the old extraction (DVC's cache holds it)")
    parser.add_argument("--old", type=Path, help="the old folder, instead of --rev")
    parser.add_argument("--new", type=Path, default=Path(OUTPUT))
    args = parser.parse_args()
    if (args.rev is None) == (args.old is None):
        parser.error("give --rev or --old")
    old = cached_files(args.rev) if args.rev else folder_files(args.old)
    new = folder_files(args.new)
    if sorted(old) != sorted(new):
        raise SystemExit(f"the folders hold different files: {sorted(old)} against {sorted(new)}")
    elements = differing = 0
    largest = squared = reference = 0.0
    for name in sorted(new):
        before, after = load_file(old[name]), load_file(new[name])
        for key, value in after.items():
            if not value.is_floating_point():
                if not torch.equal(before[key], value):
                    raise SystemExit(f"{name}: {key} differs (integer tensors must be equal)")
                continue
            difference = (before[key].float() - value.float()).abs()
            elements += difference.numel()
            differing += int((difference > 0).sum())
            largest = max(largest, float(difference.max()))
            squared += float((difference * difference).sum())
            reference += float(before[key].float().pow(2).sum())
            print(
                f"{name} {key} {tuple(value.shape)} {value.dtype}: {float((difference > 0).float().mean()):.4%} "
                f"differ, largest {float(difference.max())} (largest |value| {float(before[key].abs().max())})"
            )
    print(
        f"{elements:,} elements, {differing:,} differ ({differing / max(1, elements):.4%}), largest difference "
        f"{largest}, relative L2 {(squared / max(reference, 1e-30)) ** 0.5:.3g}"
    )


if __name__ == "__main__":
    main()
