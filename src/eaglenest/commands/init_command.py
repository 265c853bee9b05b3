"""``eaglenest init``'s declaration; the writer (:mod:`eaglenest.commands.init`) imports yaml and the params
schema (pydantic) at its top, so it is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eaglenest.commands.command import Command
from eaglenest.core.errors import EaglenestError


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "verifier",
        metavar="VERIFIER",
        help="the verifier's model folder (config.json, weights, tokenizer), or builtin:smollm2-135m-instruct",
    )
    parser.add_argument("--out", default="params.yaml", help="the file to write (default: params.yaml)")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    parser.add_argument(
        "--gpus",
        type=int,
        default=None,
        metavar="N",
        help="GPUs per node for the engines (default: those torch sees); with --gpu-memory-gib",
    )
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=None,
        metavar="GIB",
        help="memory of one GPU in GiB (default: torch's reading); with --gpus",
    )


def _run(args: argparse.Namespace) -> int:
    from eaglenest.commands.init import Gpus, init_params

    if (args.gpus is None) != (args.gpu_memory_gib is None):
        raise EaglenestError(
            "--gpus and --gpu-memory-gib go together (the engines' widths need both); give both, "
            "or neither to use the GPUs torch sees"
        )
    gpus = None if args.gpus is None else Gpus(args.gpus, args.gpu_memory_gib)
    lines, warnings = init_params(args.verifier, Path(args.out), force=args.force, gpus=gpus)
    print("\n".join(lines))
    for warning in warnings:
        print(warning, file=sys.stderr)
    return 0


COMMAND = Command(
    "init",
    help="write a params.yaml for a new verifier: aux layers, remote code, reasoning, draft layer and "
    "vocabulary, engine widths, each choice explained in a comment",
    description="Write a params.yaml for a new verifier. Reads its config.json, chat template and weight sizes "
    "(nothing is loaded, no code runs) and the GPUs torch sees; each value chosen for the verifier carries a "
    "comment saying why, and the file passes the strict params check.",
    add_arguments=_add_arguments,
    run=_run,
)
