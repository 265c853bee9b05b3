"""Training on several processes: torchrun's environment, the process group, and the collectives the loop uses.

``train.nproc: N`` (N > 1) relaunches the stage under ``torchrun --standalone`` on this machine; each
process trains on every N-th training row and DDP averages the gradients (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Distributed:
    """This process's place in a torchrun job (rank 0 of 1 when not distributed)."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()

    def mean(self, value: float) -> float:
        """The mean of ``value`` over all processes."""
        return self.sum(value) / self.world_size

    def sum(self, value: float) -> float:
        """The sum of ``value`` over all processes."""
        if self.world_size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.float64)
        torch.distributed.all_reduce(tensor)
        return float(tensor.item())


def init_distributed(device: torch.device) -> tuple[Distributed, torch.device]:
    """Joins the torchrun job if there is one (gloo on CPU, NCCL on GPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return Distributed(), device
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return Distributed(torch.distributed.get_rank(), world_size), device


def relaunch_with_torchrun(nproc: int, script: str, argv: list[str]) -> int:
    """Runs ``script argv`` under torchrun with ``nproc`` processes on this machine; returns its exit code."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               script, *argv]
    log.info("starting %d training processes: %s", nproc, " ".join(command))
    return subprocess.call(command)
