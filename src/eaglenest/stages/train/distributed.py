"""Training on several processes: torchrun's elastic launcher, the process group, and the collectives the loop uses.

``train.nproc: N`` is the global batch: N packed sequences per optimizer step. On one machine (N > 1) the stage
runs torchrun's elastic launcher itself, N processes joined by a c10d rendezvous on a free port of 127.0.0.1;
``eaglenest train-launch`` runs the same launcher on every node of a cluster with the bounds of
``cluster.torchrun``. Either way the flags of a :class:`Launch` are parsed by torchrun's own parser and handed to
its own ``run``, in this process, so the line ``eaglenest train-launch --print`` shows is what runs, and a failed
run ends in one line instead of the launcher's traceback. When a process dies the launcher restarts all of them
(up to ``cluster.torchrun.max_restarts`` times) and they resume from the last checkpoint.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
from dataclasses import dataclass

import torch

from eaglenest.core.errors import EaglenestError
from eaglenest.core.params import TorchrunParams, check_endpoint

log = logging.getLogger(__name__)

# With gloo on CPU a restarted worker group was seen to hang on the rendezvous' TCP store when the workers shared
# it with the launcher (2 processes on this project's 2-core machines); a store of the workers' own avoided it.
LAUNCHER_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
# One machine: the rendezvous on a port the operating system picks, the workers' traffic on loopback.
LOCAL_ENDPOINT = "127.0.0.1:0"
LOCAL_ADDRESS = "127.0.0.1"


@dataclass(frozen=True)
class Launch:
    """One node's torchrun elastic launch.

    Attributes:
        min_nodes: The fewest nodes the job runs on (torchrun ``--nnodes=MIN:MAX``).
        max_nodes: The most nodes that join.
        nproc_per_node: Training processes on this node.
        max_restarts: Restarts of the worker group after a failure.
        rdzv_endpoint: HOST:PORT of the c10d rendezvous store (hosted by the launcher on HOST).
        rdzv_id: The job's rendezvous id, the same on every node.
        local_addr: This node's address for the workers' traffic; None lets torch look it up.
    """

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    max_restarts: int
    rdzv_endpoint: str
    rdzv_id: str
    local_addr: str | None = None

    def flags(self) -> list[str]:
        """torchrun's flags for this launch."""
        flags = [
            f"--nnodes={self.min_nodes}:{self.max_nodes}",
            f"--nproc-per-node={self.nproc_per_node}",
            f"--max-restarts={self.max_restarts}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.rdzv_endpoint}",
            f"--rdzv-id={self.rdzv_id}",
        ]
        return flags + ([f"--local-addr={self.local_addr}"] if self.local_addr else [])

    def shell_line(self, script: str, argv: list[str]) -> str:
        """The line a shell runs on each node: the launcher's environment, torchrun, the stage script."""
        env = [f"{key}={value}" for key, value in LAUNCHER_ENV.items()]
        return shlex.join([*env, "torchrun", *self.flags(), script, *argv])


def local_launch(nproc: int, torchrun: TorchrunParams) -> Launch:
    """``nproc`` processes on this machine, all on loopback."""
    return Launch(1, 1, nproc, torchrun.max_restarts, LOCAL_ENDPOINT, torchrun.rdzv_id, local_addr=LOCAL_ADDRESS)


def cluster_launch(nproc: int, torchrun: TorchrunParams, rdzv_endpoint: str | None, rdzv_id: str | None) -> Launch:
    """One node of a multi-node job: ``cluster.torchrun``'s bounds for the global batch ``nproc``.

    Args:
        nproc: ``train.nproc``.
        torchrun: ``cluster.torchrun`` (already checked against ``nproc`` by the params).
        rdzv_endpoint: HOST:PORT given on the command line, else None for ``cluster.torchrun.rdzv_endpoint``.
        rdzv_id: The job's rendezvous id given on the command line, else None for ``cluster.torchrun.rdzv_id``.
    """
    if rdzv_endpoint is not None:
        try:
            check_endpoint(rdzv_endpoint)
        except ValueError as err:
            raise EaglenestError(f"--rdzv-endpoint {rdzv_endpoint!r}: {err}") from None
    endpoint = rdzv_endpoint or torchrun.rdzv_endpoint
    if endpoint is None:
        raise EaglenestError(
            "no rendezvous endpoint: give --rdzv-endpoint HOST:PORT (the first node, where its "
            "launcher hosts the rendezvous) or set cluster.torchrun.rdzv_endpoint"
        )
    low, high, per_node = torchrun.plan(nproc)
    assert per_node is not None, "train params' world_size_problems refuses bounds that do not divide train.nproc"
    return Launch(low, high, per_node, torchrun.max_restarts, endpoint, rdzv_id or torchrun.rdzv_id)


def run_launcher(launch: Launch, script: str, argv: list[str]) -> None:
    """Runs torchrun's elastic launcher in this process until the training processes finish.

    Raises:
        EaglenestError: one line, when the processes failed on every attempt or the rendezvous failed.
        KeyboardInterrupt: when the launcher was stopped by a signal (it stops the processes first).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser, run

    os.environ.update(LAUNCHER_ENV)
    args = get_args_parser().parse_args([*launch.flags(), script, *argv])
    log.info("starting the training processes: %s", launch.shell_line(script, argv))
    try:
        run(args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        how = (
            f"was killed by {signal.Signals(-failure.exitcode).name}"
            if failure.exitcode < 0
            else f"exited with status {failure.exitcode}"
        )
        raise EaglenestError(
            f"training process rank {rank} {how} and the launcher has no restart left (cluster.torchrun.max_restarts "
            f"= {launch.max_restarts}); its own output is above; a rerun resumes from the last checkpoint"
        ) from None
    except SignalException as err:
        log.info("launcher stopped by %s", signal.Signals(err.sigval).name)
        raise KeyboardInterrupt from None
    except RendezvousError as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise EaglenestError(f"the rendezvous at {launch.rdzv_endpoint} failed: {reason}") from None


@dataclass(frozen=True)
class Distributed:
    """This process's place in a torchrun job (rank 0 of 1 when not distributed)."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def restarts(self) -> int:
        """How many times the launcher has restarted the job's processes so far."""
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

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

    def all(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every process."""
        return self.sum(0.0 if flag else 1.0) == 0.0


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
