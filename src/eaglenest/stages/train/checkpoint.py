"""Resumable training: what identifies a run, and its checkpoints outside DVC's outputs.

Every ``train.checkpoint_every`` steps the model, optimizer, scheduler and step are saved under
``.eaglenest/train-checkpoints/<fingerprint>/`` (DVC deletes a stage's outputs before re-running it, so they
cannot live there). The fingerprint covers the train params and the content of every input, so a changed
learning rate never resumes a stale run.

No generator state is saved: :func:`seed_torch` seeds each step from the run's seed, the step and the process,
so a resumed run draws what the uninterrupted one drew on every process.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

import torch

from eaglenest.artifacts.hidden_states.format import stored_files
from eaglenest.artifacts.hidden_states.online import MANIFEST_FILE
from eaglenest.artifacts.verifier import VerifierInfo
from eaglenest.core.atomic import temp_sibling
from eaglenest.core.errors import EaglenestError
from eaglenest.core.params import TrainParams

CHECKPOINT_ROOT = Path(".eaglenest") / "train-checkpoints"
CHECKPOINT_FILE = "checkpoint.pt"


def _hash_files(paths: list[Path], digest: Any, full: bool) -> None:
    for path in sorted(paths):
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}".encode())
        if full:
            digest.update(path.read_bytes())
        else:
            with open(path, "rb") as fh:
                digest.update(fh.read(4096))  # the safetensors header (shapes, eaglenest config)


def run_fingerprint(params: TrainParams, verifier: VerifierInfo, prepared: Path, vocab: Path, hidden_states: Path
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
    process's generator advances by what its own rows hold. Seeding each step from (seed, "train", step, rank)
    gives the processes of a DDP run streams of their own, and a resumed run the draws of the uninterrupted one
    on every rank, whatever rank 0's state was when it saved the checkpoint.
    """
    digest = hashlib.sha256(":".join(str(part) for part in (seed, *labels)).encode()).digest()
    torch.manual_seed(int.from_bytes(digest[:8], "little"))


def resume(checkpoint_path: Path, model: Any, optimizer: Any, scheduler: Any) -> int:
    """Loads a checkpoint if this run has one; returns the step to continue from (0: a fresh start)."""
    if not checkpoint_path.is_file():
        return 0
    state = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return int(state["step"])


def save_checkpoint(path: Path, model: Any, optimizer: Any, scheduler: Any, step: int) -> None:
    """Writes everything a resumed run needs (atomically: a kill mid-write leaves the previous checkpoint)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    try:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "step": step}, tmp)
    except (OSError, RuntimeError) as err:
        # A full disk surfaces from torch's zip writer as "unexpected pos ...": name the file and the free space.
        tmp.unlink(missing_ok=True)
        free = shutil.disk_usage(path.parent).free / 2**20
        raise EaglenestError(
            f"could not write the training checkpoint {path} at step {step} ({str(err).splitlines()[0]}; "
            f"{free:.0f} MiB free there); free disk space and run the stage again: it resumes from the last "
            f"checkpoint"
        ) from None
    tmp.replace(path)


def trim_live_history(live_dir: Path, start_step: int) -> None:
    """On resume, drop dvclive rows logged after the checkpoint (they are about to be logged again)."""
    for tsv in live_dir.glob("plots/metrics/**/*.tsv"):
        lines = tsv.read_text().splitlines()
        kept = [lines[0]] + [line for line in lines[1:] if int(line.split("\t")[0]) <= start_step]
        tsv.write_text("\n".join(kept) + "\n")
