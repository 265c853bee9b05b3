"""``eaglenest k-sweep``: the k_sweep stage's timing by hand, for other Ks or more rounds than params.yaml's.

The pipeline's own sweep is the k_sweep stage (``dvc repro`` runs it after train: ``k_sweep`` in params.yaml);
this runs the same code (:func:`eaglenest.stages.k_sweep.sweep`) in a checkout whose pipeline is up to date::

    eaglenest k-sweep [--ks 1 2 3 4] [--repeats 2] [--out FILE]

It writes the same record (:mod:`eaglenest.artifacts.k_record`), by default over the stage's
``metrics/k_sweep.json``, which ``eaglenest serve`` reads; ``dvc status`` then names that output modified, and
the next ``dvc repro`` of the stage measures params.yaml's Ks again (``dvc exp run -S 'k_sweep.ks=[1,2,3,4]'``
keeps other Ks in the pipeline).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from eaglenest.artifacts.k_record import K_RECORD_FILE
from eaglenest.commands.command import Command
from eaglenest.core.errors import EaglenestError


def run_sweep(
    params_file: Path, verifier: Path, draft: Path, prepared: Path, out: Path, ks: list[int] | None, repeats: int | None
) -> dict[str, Any]:
    """The stage's sweep on these folders with ``ks`` and ``repeats`` in place of params.yaml's (None: its)."""
    from eaglenest.core.params import load_sections
    from eaglenest.stages.k_sweep import KSweepPaths, sweep
    from eaglenest.stages.k_sweep.params import KSweepStageParams

    if repeats is not None and repeats < 1:
        raise EaglenestError(f"--repeats {repeats}: must be at least 1")
    if ks and min(ks) < 1:
        raise EaglenestError(f"--ks {' '.join(map(str, ks))}: every K must be at least 1")
    params = load_sections(params_file, KSweepStageParams)
    return sweep(params, KSweepPaths(verifier, prepared, draft, out), ks, repeats)


def summary_lines(record: dict[str, Any]) -> list[str]:
    """What the sweep found: per set the draft's speed-up at each K, and the K serve will use."""
    if record["serve_k"] is None:
        return [f"no K measured: {record['not_measured']}"]
    lines = []
    for name, entry in record["best"].items():
        lines.append(
            f"{name}: "
            + "; ".join(
                f"{drafter} "
                + ", ".join(f"K={k} x{v}" for k, v in figures["mean_speedup_per_k"].items())
                + f" (best K {figures['k']})"
                for drafter, figures in entry.items()
            )
        )
    serve = record["serve"]
    lines.append(
        f"serve_k {serve['k']}: x{serve['speedup']} ± {serve['speedup_ci95']} on {', '.join(serve['sets'])} "
        f"(the draft's own K is {record['draft']['trained_k']}); `eaglenest serve` uses it for this draft"
    )
    return lines


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ks", nargs="+", type=int, default=None, metavar="K", help="the Ks to time (default: k_sweep.ks)"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="rounds on the same engines (default: k_sweep.repeats)"
    )
    parser.add_argument(
        "--out", default=str(K_RECORD_FILE), help=f"the K record (default: {K_RECORD_FILE}, the stage's)"
    )
    parser.add_argument("--params", default="params.yaml", help="the pipeline's params (default: params.yaml)")
    parser.add_argument("--verifier", default="models/verifier", help="the verifier stage's output folder")
    parser.add_argument("--draft", default="models/draft", help="the train stage's draft checkpoint")
    parser.add_argument("--prepared", default="data/prepared", help="the prepare stage's dataset (val sets)")


def _run(args: argparse.Namespace) -> int:
    print(
        "\n".join(
            summary_lines(
                run_sweep(
                    Path(args.params),
                    Path(args.verifier),
                    Path(args.draft),
                    Path(args.prepared),
                    Path(args.out),
                    args.ks,
                    args.repeats,
                )
            )
        )
    )
    return 0


COMMAND = Command(
    "k-sweep",
    help="the k_sweep stage's timing by hand, for other Ks or rounds than params.yaml's k_sweep: "
    "the draft at each K, single-stream on the headline sets; records the fastest K for `eaglenest serve`",
    add_arguments=_add_arguments,
    run=_run,
)
