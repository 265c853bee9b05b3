"""Resumable training: what identifies a run, and its checkpoints outside DVC's outputs.

Every ``train.checkpoint_every`` steps rank 0 saves the model, every optimizer and its schedule, the step and every
curve value logged so far under ``.eaglenest/train-checkpoints/<fingerprint>/`` (``cluster.torchrun.checkpoint_dir``
moves it; DVC deletes a stage's outputs before re-running it, so they cannot live there). A resumed run, after a
rerun or a restart by torchrun's launcher, loads it on every process and writes the curves again (dvclive/train is
an ordinary output). The fingerprint covers the train params and the content of every input, so a changed
learning rate or optimizer never resumes a stale run; it leaves out how many processes share the global batch, which
changes nothing trained.

Each checkpoint is written to a temporary file, fsync'd and renamed in (:func:`~eaglenest.core.atomic.atomic_open`),
and the one it replaces is kept as ``checkpoint.prev.pt``: a checkpoint torn by a power loss or a full disk, which
torch cannot read, is named in one line and the run resumes from the previous one; with neither readable it starts
from step 0. While the run trains, rank 0 holds the lock of its checkpoint folder (:mod:`eaglenest.core.lock`):
a second training of the same run (two checkouts sharing ``cluster.torchrun.checkpoint_dir``) is refused in one line
instead of writing its checkpoints over the first's.

No generator state is saved: :func:`seed_torch` seeds each sequence of a step from the run's seed, the step and
the sequence's place in the global batch, so a resumed run draws what the uninterrupted one drew.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
import shutil
import socket
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from eaglenest.artifacts.hidden_states.format import stored_files
from eaglenest.artifacts.hidden_states.online import MANIFEST_FILE
from eaglenest.artifacts.verifier import VerifierInfo
from eaglenest.core.atomic import atomic_open, atomic_write_bytes
from eaglenest.core.errors import EaglenestError
from eaglenest.core.lock import exclusive, lock_file_for
from eaglenest.stages.train.curves import Logged
from eaglenest.stages.train.distributed import Distributed
from eaglenest.stages.train.params import TrainParams

CHECKPOINT_ROOT = Path(".eaglenest") / "train-checkpoints"
CHECKPOINT_FILE = "checkpoint.pt"
PREVIOUS_FILE = "checkpoint.prev.pt"  # the checkpoint before the newest, kept until the next one is in place
# What torch.load raises for a file that is not a whole checkpoint: a torn zip archive (RuntimeError), zeros or
# garbage (UnpicklingError, BadZipFile, EOFError), an unreadable file (OSError).
UNREADABLE = (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile)

log = logging.getLogger(__name__)


def _hash_files(paths: list[Path], digest: Any, full: bool) -> None:
    for path in sorted(paths):
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}".encode())
        if full:
            digest.update(path.read_bytes())
        else:
            with open(path, "rb") as fh:
                digest.update(fh.read(4096))  # the safetensors header (shapes, eaglenest config)


def run_fingerprint(
    params: TrainParams, verifier: VerifierInfo, prepared: Path, vocab: Path, hidden_states: Path
) -> str:
    """Identifies a training run: params and the content of every input (the prepared data, the vocabulary and
    the hidden-state files' headers)."""
    digest = hashlib.sha256(params.model_dump_json().encode())
    digest.update(verifier.model_dump_json().encode())
    _hash_files([p for p in prepared.iterdir() if p.is_file()], digest, full=True)
    _hash_files([p for p in vocab.iterdir() if p.is_file()], digest, full=True)
    _hash_files(stored_files(hidden_states), digest, full=False)
    _hash_files([p for p in [hidden_states / MANIFEST_FILE] if p.is_file()], digest, full=True)  # store: online
    return digest.hexdigest()[:24]


def seed_torch(seed: int, *labels: object) -> None:
    """Seeds torch's generators (CPU and every GPU) from ``train.seed`` and ``labels`` alone.

    P-EAGLE and DFlash sample positions at random (``torch.randperm`` over a batch's valid tokens), so a
    process's generator advances by what its own rows hold. Seeding each sequence of a step from (seed, "train",
    step, its place in the global batch) gives every sequence a stream of its own, the same whichever process
    trains it, and a resumed run the draws of the uninterrupted one, whatever the state of any generator was when
    rank 0 saved the checkpoint and however many processes share the global batch after it.
    """
    digest = hashlib.sha256(":".join(str(part) for part in (seed, *labels)).encode()).digest()
    torch.manual_seed(int.from_bytes(digest[:8], "little"))


def optimizer_kinds(optimizers: list[Any]) -> list[str]:
    """The optimizers' class names in order (``["AdamW"]``, ``["Muon", "AdamW"]``): what a checkpoint's optimizer
    states belong to."""
    return [type(optimizer).__name__ for optimizer in optimizers]


def previous_of(checkpoint_path: Path) -> Path:
    """Where the checkpoint before ``checkpoint_path`` is kept."""
    return checkpoint_path.with_name(PREVIOUS_FILE)


def load_state(checkpoint_path: Path) -> tuple[dict[str, Any] | None, Path | None]:
    """The newest readable checkpoint of a run and its file: ``checkpoint_path``, else the one before it.

    A checkpoint that torch cannot read is one line (the file and torch's reason) and the previous one is tried; with
    none readable the run starts from step 0, rather than refusing: a torn file holds nothing to resume from, so
    deleting it (all a refusal could ask) would start the same fresh run, and the next checkpoint replaces it.
    """
    candidates = [path for path in (checkpoint_path, previous_of(checkpoint_path)) if path.is_file()]
    for path in candidates:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(state, dict) or "model" not in state or "step" not in state:
                raise ValueError("not a training checkpoint (no model or step)")
        except UNREADABLE as err:
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            log.warning("%s: unreadable checkpoint (%s), torn by a crash or a full disk?", path, reason)
            continue
        return state, path
    if candidates:
        log.warning("%s: no readable checkpoint; training starts again from step 0", checkpoint_path.parent)
    return None, None


def resume(checkpoint_path: Path, model: Any, optimizers: list[Any], schedulers: list[Any]) -> tuple[int, Logged]:
    """Loads the run's newest readable checkpoint (:func:`load_state`), if any: the model, every optimizer and every
    schedule.

    The run's fingerprint covers ``train.optimizer`` and ``train.muon``, so a run finds only its own checkpoints;
    one whose optimizers are not this run's (a checkpoint copied in by hand) is refused in one line rather than
    half loaded.

    Returns:
        The step to continue from (0: a fresh start) and the curve values logged up to it.

    Raises:
        EaglenestError: the checkpoint holds other optimizers, or states that do not fit them.
    """
    state, path = load_state(checkpoint_path)
    if state is None or path is None:
        return 0, []
    # A checkpoint from before the optimizer was a choice holds one AdamW and one schedule.
    saved_optimizers = state["optimizers"] if "optimizers" in state else [state["optimizer"]]
    saved_schedulers = state["schedulers"] if "schedulers" in state else [state["scheduler"]]
    saved_kinds = state.get("optimizer_kinds", ["AdamW"])
    kinds = optimizer_kinds(optimizers)
    if saved_kinds != kinds or len(saved_optimizers) != len(optimizers) or len(saved_schedulers) != len(schedulers):
        raise EaglenestError(
            f"{path}: a checkpoint of a run with the optimizers {'+'.join(saved_kinds)}, and this run "
            f"trains with {'+'.join(kinds)} (train.optimizer); delete {path.parent} to start afresh"
        )
    try:
        model.load_state_dict(state["model"])
        for optimizer, saved in zip(optimizers, saved_optimizers, strict=True):
            optimizer.load_state_dict(saved)
        for scheduler, saved in zip(schedulers, saved_schedulers, strict=True):
            scheduler.load_state_dict(saved)
    except (RuntimeError, ValueError, KeyError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise EaglenestError(
            f"{path}: does not fit this run's draft and optimizers ({reason}); delete {path.parent} to start afresh"
        ) from None
    # A checkpoint from before curves were kept resumes with the curves from its step on.
    curves = state.get("curves", [])
    return int(state["step"]), [(int(step), str(name), float(value)) for step, name, value in curves]


def save_checkpoint(
    path: Path, model: Any, optimizers: list[Any], schedulers: list[Any], step: int, curves: Logged
) -> None:
    """Writes everything a resumed run needs: the model, every optimizer and its schedule, the step and the curves;
    atomically and fsync'd, the checkpoint it replaces kept as the previous one (:func:`load_state`)."""
    state = {
        "model": model.state_dict(),
        "optimizers": [optimizer.state_dict() for optimizer in optimizers],
        "optimizer_kinds": optimizer_kinds(optimizers),
        "schedulers": [scheduler.state_dict() for scheduler in schedulers],
        "step": step,
        "curves": [list(entry) for entry in curves],
    }
    try:
        with atomic_open(path) as fh:
            torch.save(state, fh)
            # The new checkpoint is whole in its temporary: the current one becomes the previous one only now, so
            # a failed write keeps both, and a kill between the two renames leaves the previous one to resume from.
            if path.is_file():
                os.replace(path, previous_of(path))
    except (OSError, RuntimeError, EaglenestError) as err:
        # A full disk surfaces from torch's zip writer as "unexpected pos ...": name the file and the free space.
        free = shutil.disk_usage(path.parent).free / 2**20
        raise EaglenestError(
            f"could not write the training checkpoint {path} at step {step} ({str(err).splitlines()[0]}; "
            f"{free:.0f} MiB free there); free disk space and run the stage again: it resumes from the last "
            f"checkpoint"
        ) from None


@contextlib.contextmanager
def checkpoint_writer(run_dir: Path, dist: Distributed) -> Iterator[None]:
    """Holds the lock of the run's checkpoint folder on rank 0 (the one process that writes there) for the block;
    every process is refused in one line when another training of the same run holds it.

    The lock is not held across torchrun's restarts: a restart ends every training process, and with them the lock.
    """
    with contextlib.ExitStack() as held:
        refusal = None
        if dist.is_main:
            try:
                held.enter_context(exclusive(lock_file_for(run_dir), str(run_dir)))
            except EaglenestError as err:
                refusal = str(err)
        if not dist.all(refusal is None):
            raise EaglenestError(refusal or f"{run_dir}: rank 0 could not lock it (its own line says why)")
        yield


# Written by rank 0 into the run's checkpoint folder and read back by every process: a folder that some node
# does not share would let its processes start afresh while rank 0 resumes.
LAUNCH_MARKER = "launch"


def check_shared(run_dir: Path, dist: Distributed) -> None:
    """Refuses a checkpoint folder that some training process cannot see (several nodes without shared storage).

    Rank 0 writes a marker naming this launch (the launcher's run id, rendezvous and restart count, the same on
    every process of one attempt); every process reads it back.
    """
    if dist.world_size == 1:
        return
    names = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")
    token = ":".join(os.environ.get(name, "") for name in names)
    marker = run_dir / LAUNCH_MARKER
    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(marker, token.encode())
    dist.barrier()
    try:
        seen = marker.read_text() == token
    except OSError:
        seen = False
    if not dist.all(seen):
        who = (
            "another training process (its own line names it)"
            if seen
            else (f"rank {dist.rank} of {dist.world_size}, on {socket.gethostname()},")
        )
        raise EaglenestError(
            f"{run_dir}: {who} cannot read what rank 0 wrote there, so it would not resume from rank 0's "
            "checkpoints; point cluster.torchrun.checkpoint_dir at storage every node mounts at the same path"
        )
