"""``eaglenest train-launch``'s declaration; the launcher (:mod:`eaglenest.commands.train_launch`) imports
yaml and the params schema (pydantic) at its top, so it is imported only when the command runs.
"""

from __future__ import annotations

import argparse

from eaglenest.commands.command import Command


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="the rendezvous, on the first node (default: cluster.torchrun.rdzv_endpoint)",
    )
    parser.add_argument(
        "--rdzv-id",
        default=None,
        metavar="ID",
        help="the job's rendezvous id, the same on every node (default: cluster.torchrun.rdzv_id)",
    )
    parser.add_argument(
        "--print",
        action="store_true",
        help="print the exact line (environment, torchrun and its flags, the stage) and exit",
    )


def _run(args: argparse.Namespace) -> int:
    from eaglenest.commands.train_launch import train_launch

    return train_launch(args.rdzv_endpoint, args.rdzv_id, args.print)


COMMAND = Command(
    "train-launch",
    help="this node's part of a multi-node training run: torchrun's elastic launcher on the "
    "train stage, built from params.yaml (train.nproc, cluster.torchrun) and dvc.yaml",
    description="This node's part of a multi-node training run: torchrun's elastic launcher (c10d rendezvous, "
    "restarts from the last checkpoint) on the train stage, with the stage's script and paths from dvc.yaml "
    "and the node bounds, processes per node and restarts from cluster.torchrun. Run it on every node, in the "
    "checkout's root (scripts/cluster/train.sbatch does, under Slurm); then `dvc commit train` records the "
    "outputs. --print shows the line instead of running it.",
    add_arguments=_add_arguments,
    run=_run,
)
