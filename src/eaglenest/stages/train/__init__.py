"""The train stage: a draft (``train.algorithm``) with speculators' model, loss and data classes, and our own
loop.

The loop is ours so that it runs on a CPU as well as a GPU (speculators' Trainer assumes a GPU). Its parts
live beside it: :mod:`~eaglenest.stages.train.data` (speculators' data set and collation, packed batches in a
deterministic order), :mod:`~eaglenest.stages.train.model` (the draft, and how it runs on this device),
:mod:`~eaglenest.stages.train.validation` (in-training validation: loss, accuracy, tau_sim),
:mod:`~eaglenest.stages.train.optimization` (one optimizer step), :mod:`~eaglenest.stages.train.checkpoint` (resume
after a kill), :mod:`~eaglenest.stages.train.curves` (dvclive, rewritten on resume) and
:mod:`~eaglenest.stages.train.distributed` (several processes under torchrun's elastic launcher). The stage runs in
three phases: :func:`setup_training`, :func:`fit` and :func:`finish_training`.

Each optimizer step trains on the global batch, ``train.nproc`` packed sequences drawn from one stream over all the
training rows; process r of W takes sequences r, r + W, ... and accumulates their gradients, DDP averages over
processes. So the steps are the same arithmetic whatever W divides ``train.nproc``, and a run that lost a node
resumes on the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eaglenest.artifacts.draft import save_draft
from eaglenest.artifacts.hidden_states.stream import StreamMeter
from eaglenest.artifacts.prepared import load_split, load_table
from eaglenest.artifacts.verifier import VerifierInfo, load_verifier_info
from eaglenest.artifacts.vocab import load_vocab
from eaglenest.core.atomic import atomic_write_json
from eaglenest.core.checkout import checkout_path
from eaglenest.core.device import pick_device
from eaglenest.core.errors import EaglenestError
from eaglenest.core.host import host_record
from eaglenest.core.params import ClusterParams
from eaglenest.core.progress import progress
from eaglenest.core.stage import Stage, VocabInput, path_arg
from eaglenest.stages.train.checkpoint import (
    CHECKPOINT_FILE,
    CHECKPOINT_ROOT,
    check_shared,
    checkpoint_writer,
    resume,
    run_fingerprint,
    save_checkpoint,
    seed_torch,
)
from eaglenest.stages.train.curves import Curves
from eaglenest.stages.train.data import PackedBatches, TrainingData, checked_rows, load_training_data, pack_batches
from eaglenest.stages.train.distributed import Distributed, init_distributed, local_launch, run_launcher
from eaglenest.stages.train.model import Runtime, build_draft, draft_runtime
from eaglenest.stages.train.optimization import Optimization, backward, build_optimization, optimizer_step
from eaglenest.stages.train.params import TrainParams, TrainStageParams
from eaglenest.stages.train.stream import StreamTransfer, planned_batches
from eaglenest.stages.train.validation import validate_draft

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainPaths(VocabInput):
    """Where dvc.yaml puts the train stage's inputs and outputs; resumable checkpoints live outside them."""

    out: Path = path_arg("the draft checkpoint folder (models/draft)")
    metrics: Path = path_arg("the headline metrics JSON (metrics/train.json): tau_sim and the validation loss")
    details: Path = path_arg("every training figure and count (metrics/train_details.json)")
    live_dir: Path = path_arg("dvclive folder (dvclive/train)")
    checkpoints: Path = CHECKPOINT_ROOT


@dataclass
class TrainSession:
    """Everything the fit phase needs, built by :func:`setup_training`.

    Attributes:
        params: The train params.
        paths: The stage's paths.
        verifier: The verifier stage's record.
        dist: This process's place among the training processes.
        runtime: How the draft runs on this device.
        data: The training data.
        model: The draft (unwrapped).
        network: What the forward runs: the draft, or its DDP wrapper with several processes.
        optimization: The optimizers (``train.optimizer``) and their learning-rate schedules.
        checkpoint_path: Where this run's resumable checkpoint lives.
        start_step: The step this run continues from (0: a fresh start).
        val_batches: The validation rows, packed.
        train_batches: The global batches' sequences from ``start_step`` on, ``params.nproc`` a step (the same
            stream on every process).
        curves: The curves (dvclive) on the main process, else None.
    """

    params: TrainParams
    paths: TrainPaths
    verifier: VerifierInfo
    dist: Distributed
    runtime: Runtime
    data: TrainingData
    model: Any
    network: Any
    optimization: Optimization
    checkpoint_path: Path
    start_step: int
    val_batches: list[list[int]]
    train_batches: Iterator[list[int]]
    curves: Curves | None


@dataclass
class FitResult:
    """What the fit phase measured.

    Attributes:
        train_loss: The last step's training loss (mean over processes).
        validation: The last validation's figures.
        seconds: Wall time of the fit, validation and checkpoints included.
        step_seconds: Time in training steps only.
        trained_tokens: Real (unpadded) tokens trained on, over all processes.
    """

    train_loss: float
    validation: dict[str, Any]
    seconds: float
    step_seconds: float
    trained_tokens: float


def setup_training(
    params: TrainParams, paths: TrainPaths, held: contextlib.ExitStack, cluster: ClusterParams | None = None
) -> TrainSession:
    """Phase 1: data, draft, optimizer and the resumed state, on every process; the lock of the run's checkpoint
    folder taken into ``held`` (rank 0's, for as long as the caller keeps it); with ``extract.store: stream``, the
    engines started on ``cluster`` (until ``held`` closes)."""
    verifier, model_dir = load_verifier_info(paths.verifier)
    vocab, d2t, t2d = load_vocab(paths.vocab)
    dist, device = init_distributed(pick_device(params.device, "train.device"))
    if params.nproc % dist.world_size:
        raise EaglenestError(
            f"train.nproc = {params.nproc} (the global batch) is not a multiple of the "
            f"{dist.world_size} training processes; launch a number of them that divides it"
        )
    runtime = draft_runtime(params, device)
    data = load_training_data(
        params,
        verifier,
        paths.prepared,
        paths.hidden_states,
        paths.vocab,
        runtime.hs_dtype,
        model_dir=model_dir,
        device=device,
        cluster=cluster,
    )
    if data.online is not None:
        held.callback(data.online.close)
    model = build_draft(verifier, model_dir, params, vocab["draft_vocab_size"], d2t, t2d, runtime.attention)
    model = model.to(device)
    model.train()
    optimization = build_optimization(model, params)

    fingerprint = run_fingerprint(params, verifier, paths.prepared, paths.vocab, paths.hidden_states)
    checkpoint_path = paths.checkpoints / fingerprint / CHECKPOINT_FILE
    held.enter_context(checkpoint_writer(checkpoint_path.parent, dist))
    check_shared(checkpoint_path.parent, dist)
    start_step, logged = resume(checkpoint_path, model, optimization.optimizers, optimization.schedulers)
    if dist.restarts and dist.is_main:
        log.info("restart %d by torchrun's launcher, after a training process was lost", dist.restarts)
    if start_step and dist.is_main:
        log.info("resuming run %s from step %d (%s)", fingerprint, start_step, checkpoint_path)
    curves = Curves(paths.live_dir, logged) if dist.is_main else None
    dist.barrier()
    rows, lengths = data.rows, data.lengths
    val_batches = pack_batches(rows["val"], lengths, params.total_seq_len, params.seed, epoch=0)
    packed = PackedBatches(rows["train"], lengths, params.total_seq_len, params.seed)
    train_batches = packed.from_step(start_step * params.nproc)
    if isinstance(data.online, StreamTransfer):  # the engines start on this process's plan
        data.online.stream.start(
            planned_batches(
                packed.from_step(start_step * params.nproc),
                params.nproc,
                range(dist.rank, params.nproc, dist.world_size),
                range(start_step, params.steps),
                val_batches if dist.is_main else None,
                functools.partial(validates_after, params),
            )
        )
    network = (
        torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        if dist.world_size > 1
        else model
    )
    return TrainSession(
        params,
        paths,
        verifier,
        dist,
        runtime,
        data,
        model,
        network,
        optimization,
        checkpoint_path,
        start_step,
        val_batches,
        train_batches,
        curves,
    )


def _validate(session: TrainSession, step: int) -> dict[str, Any]:
    """Rank 0 validates on the unwrapped model (no collectives); the others wait."""
    result: dict[str, Any] = {}
    if session.curves is not None:
        seed_torch(session.params.seed, "val", step)  # P-EAGLE and DFlash sample their validation positions too
        result = validate_draft(session.model, session.data, session.val_batches, session.runtime)
        _log_validation(session.curves, step, result)
    session.dist.barrier()
    return result


def validates_after(params: TrainParams, done: int) -> bool:
    """Whether training validates after step ``done`` (counted from 1): every ``train.eval_every``, and the last."""
    return done % params.eval_every == 0 or done == params.steps


def fit(session: TrainSession) -> FitResult:
    """Phase 2: the training steps from ``session.start_step``, with validation and checkpoints on schedule."""
    params, dist, curves, device = session.params, session.dist, session.curves, session.runtime.device
    # This process's sequences of each global batch: r, r + W, ...; each counts 1 / share of its gradient.
    mine = range(dist.rank, params.nproc, dist.world_size)
    if session.start_step == 0:  # the curves start at the untrained draft, so progress shows
        _validate(session, 0)
    started = time.perf_counter()
    result = FitResult(train_loss=float("nan"), validation={}, seconds=0.0, step_seconds=0.0, trained_tokens=0.0)
    # Rank 0's meter: steps with the loss, tokens/s and the ETA (a resumed run counts from where it stopped).
    meter = progress(params.steps, "optimizer steps", "step", initial=session.start_step, disable=not dist.is_main)
    for step in range(session.start_step, params.steps):
        step_started = time.perf_counter()
        sequences = [next(session.train_batches) for _ in range(params.nproc)]  # the global batch
        losses, my_tokens = [], 0
        for i, index in enumerate(mine):
            # Seeded by the sequence's place in the global batch, not the process: the same draws for any W.
            seed_torch(params.seed, "train", step, index)
            batch = session.data.batch(sequences[index], device, training=True)
            losses.append(
                backward(session.network, batch, session.runtime, params, share=len(mine), sync=i == len(mine) - 1)
            )
            my_tokens += sum(session.data.lengths[r] for r in sequences[index])
        optimizer_step(session.optimization, params)
        done = step + 1
        result.step_seconds += time.perf_counter() - step_started
        tokens = dist.sum(my_tokens)
        result.trained_tokens += tokens
        result.train_loss = dist.mean(sum(losses) / len(losses))
        if not math.isfinite(result.train_loss):
            raise EaglenestError(
                f"training loss became {result.train_loss} at step {done}; lower train.lr ({params.lr})"
            )
        if curves is not None:
            curves.log(done, "train/loss", result.train_loss)
            for name, rate in session.optimization.learning_rates().items():  # train/lr, and Muon's
                curves.log(done, name, rate)
            curves.log(done, "train/tokens_per_s", tokens / (time.perf_counter() - step_started))
        meter.update(1)
        meter.set_postfix(
            loss=f"{result.train_loss:.3f}",
            tok_s=f"{result.trained_tokens / result.step_seconds:.0f}",
            **stream_postfix(session.data),
            refresh=False,
        )
        if validates_after(params, done):
            result.validation = _validate(session, done)
        if done % params.checkpoint_every == 0 and done < params.steps:
            if curves is not None:
                save_checkpoint(
                    session.checkpoint_path,
                    session.model,
                    session.optimization.optimizers,
                    session.optimization.schedulers,
                    done,
                    curves.logged,
                )
            dist.barrier()
    meter.close()
    result.seconds = time.perf_counter() - started
    return result


def finish_training(session: TrainSession, result: FitResult) -> dict[str, Any]:
    """Phase 3: the main process saves the draft and the metrics and drops the finished run's checkpoint."""
    params, paths, data, dist = session.params, session.paths, session.data, session.dist
    metrics: dict[str, Any] = {}
    if session.curves is not None:
        session.curves.end()
        save_draft(session.model, paths.out, params.verifier_name or session.verifier.name)
        validation = result.validation
        metrics = {
            "steps": params.steps,
            "steps_this_run": params.steps - session.start_step,
            "resumed_from_step": session.start_step,
            "train_loss": round(result.train_loss, 6),
            "val_loss": round(validation["val_loss"], 6),
            "val_acc": [round(a, 6) for a in validation["val_acc"]],
            "val_cond_acc": [round(a, 6) for a in validation["val_cond_acc"]],
            # The same per TTT step under flat names: `dvc metrics diff` shows scalars only.
            **{f"val_acc_{i}": round(a, 6) for i, a in enumerate(validation["val_acc"])},
            "tau_sim": round(validation["tau_sim"], 4),
            # Real (unpadded) tokens per second of training steps; validation time is not counted.
            "tokens_per_s": round(result.trained_tokens / result.step_seconds, 1) if result.trained_tokens else None,
            "seconds": round(result.seconds, 3),
            "device": session.runtime.device.type,
            "precision": session.runtime.precision,
            "algorithm": params.algorithm,
            "optimizer": params.optimizer,
            "loss_tokens": params.loss_tokens,
            "processes": dist.world_size,
            "launcher_restarts": dist.restarts,
            "hidden_states": hidden_state_source(data),
            **stream_figures(data),
            "train_rows": len(data.rows["train"]),
            "val_rows": len(data.rows["val"]),
            "split_train_rows": load_split(paths.prepared)["train_rows"],
            # kernels differ by CPU kind: the same commit trains another draft on another kind
            "host": host_record(session.runtime.precision),
        }
        atomic_write_json(paths.details, metrics)
        atomic_write_json(paths.metrics, headline_metrics(metrics))
        shutil.rmtree(session.checkpoint_path.parent, ignore_errors=True)  # finished: the draft itself is the result
    dist.barrier()
    return metrics


def hidden_state_source(data: TrainingData) -> str:
    """Where training's hidden states came from: files, online (the verifier in this process) or stream."""
    if data.online is None:
        return "files"
    return "stream" if isinstance(data.online, StreamTransfer) else "online"


def stream_meter(data: TrainingData) -> StreamMeter | None:
    """The meter of a started stream (``extract.store: stream``), else None."""
    return data.online.stream.meter if isinstance(data.online, StreamTransfer) else None


def stream_figures(data: TrainingData) -> dict[str, Any]:
    """A stream's figures (``{"stream": {...}}``): engines, rows/s, the trainer's wait; nothing for other stores."""
    meter = stream_meter(data)
    return {} if meter is None else {"stream": meter.figures()}


def stream_postfix(data: TrainingData) -> dict[str, str]:
    """The progress line's stream figures: engine rows/s, batches ready ahead of the trainer out of the buffer, and
    the share of time the trainer waited for them (the figure that says to add engines)."""
    meter = stream_meter(data)
    if meter is None:
        return {}
    figures = meter.figures()
    return {
        "rows_s": f"{figures['engine_rows_per_s']:.1f}",
        "buffer": f"{meter.ready}/{meter.window}",
        "waited": f"{figures['wait_share']:.0%}",
    }


# The validation loss is averaged over the tokens train.loss_tokens selects; its name says which.
VAL_LOSS_NAMES = {"all": "val_loss_all_tokens", "replies": "val_loss_reply_tokens"}


def headline_metrics(details: dict[str, Any]) -> dict[str, Any]:
    """What ``dvc metrics diff`` shows of training: tau_sim (the acceptance length the validation split predicts
    under teacher forcing, beside the decoded tau of the same split in metrics/eval/details.json: ``val``) and the
    validation loss, named by the tokens it covers."""
    return {"tau_sim": details["tau_sim"], VAL_LOSS_NAMES[details["loss_tokens"]]: details["val_loss"]}


def train_draft(params: TrainParams, paths: TrainPaths, cluster: ClusterParams | None = None) -> dict[str, Any]:
    """The train stage's work: set up, fit, finish; returns the metrics it writes (empty on other processes).
    ``cluster``: where the engines of ``extract.store: stream`` run (None: engine processes on this machine)."""
    with contextlib.ExitStack() as held:  # the checkpoint folder's lock, until the finished run has removed it
        session = setup_training(params, paths, held, cluster)
        return finish_training(session, fit(session))


def _log_validation(curves: Curves, step: int, result: dict[str, Any]) -> None:
    """One validation's figures as dvclive metrics at ``step`` (and one log line)."""
    curves.log(step, "val/loss", result["val_loss"])
    for i, full in enumerate(result["val_acc"]):
        curves.log(step, f"val/acc_{i}", full)
    for i, cond in enumerate(result["val_cond_acc"]):  # eagle3 only
        curves.log(step, f"val/cond_acc_{i}", cond)
    curves.log(step, "val/tau_sim", result["tau_sim"])
    log.info(
        "step %d: val loss %.4f, acc %s, tau_sim %.3f",
        step,
        result["val_loss"],
        [round(a, 3) for a in result["val_acc"]],
        result["tau_sim"],
    )


def check_inputs(params: TrainParams, paths: TrainPaths) -> None:
    """What the training processes would each refuse, checked once before they start: the verifier record and
    the rows against ``train.total_seq_len``."""
    load_verifier_info(paths.verifier)
    checked_rows(params, paths.vocab, load_table(paths.prepared).column("seq_len").to_pylist())


def placed(params: TrainStageParams, paths: TrainPaths) -> TrainPaths:
    """``paths`` with the checkpoints where ``cluster.torchrun.checkpoint_dir`` puts them, in the checkout's
    ``.eaglenest/`` by default: also from a queued experiment's copy (:func:`~eaglenest.core.checkout.checkout_path`),
    so that a killed one resumes when queued again and experiments of other params or inputs never meet (the
    run's fingerprint keys its folder)."""
    folder = params.cluster.torchrun.checkpoint_dir
    return dataclasses.replace(paths, checkpoints=checkout_path(Path(folder) if folder else paths.checkpoints))


def run(params: TrainStageParams, paths: TrainPaths) -> dict[str, Any]:
    """The train stage; with ``train.nproc`` > 1 and not yet under torchrun, it runs torchrun's elastic launcher
    on this script, ``train.nproc`` processes on this machine."""
    train, paths = params.train, placed(params, paths)
    if train.nproc > 1 and "LOCAL_RANK" not in os.environ:
        check_inputs(train, paths)
        run_launcher(local_launch(train.nproc, params.cluster.torchrun), sys.argv[0], sys.argv[1:])
        return {}
    return train_draft(train, paths, params.cluster)


STAGE = Stage(
    "train",
    "The draft (EAGLE-3, P-EAGLE or DFlash), trained on the hidden states, logged with dvclive, resumable.",
    TrainStageParams,
    TrainPaths,
    run,
)
