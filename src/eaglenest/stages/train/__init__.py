"""The train stage: an EAGLE-3 draft with speculators' model, loss and data classes, and our own loop.

The loop is ours so that it runs on a CPU as well as a GPU (speculators' Trainer assumes a GPU). Its parts
live beside it: :mod:`~eaglenest.stages.train.data` (speculators' data set and collation, packed batches in a
deterministic order), :mod:`~eaglenest.stages.train.model` (the draft, and how it runs on this device),
:mod:`~eaglenest.stages.train.validation` (in-training validation: loss, accuracy, tau_sim),
:mod:`~eaglenest.stages.train.checkpoint` (resume after a kill) and :mod:`~eaglenest.stages.train.distributed`
(several processes under torchrun).
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eaglenest.artifacts.draft import save_draft
from eaglenest.artifacts.prepared import load_split
from eaglenest.artifacts.verifier import load_verifier_info
from eaglenest.artifacts.vocab import load_vocab
from eaglenest.core.atomic import atomic_write_json
from eaglenest.core.device import pick_device
from eaglenest.core.errors import EaglenestError
from eaglenest.core.params import TrainParams
from eaglenest.stages.train.checkpoint import (
    CHECKPOINT_FILE,
    CHECKPOINT_ROOT,
    resume,
    run_fingerprint,
    save_checkpoint,
    trim_live_history,
)
from eaglenest.stages.train.data import PackedBatches, load_training_data, pack_batches
from eaglenest.stages.train.distributed import init_distributed
from eaglenest.stages.train.model import build_draft, draft_runtime
from eaglenest.stages.train.validation import validate_draft

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class TrainInputs:
    """Paths of the train stage's inputs and outputs (from dvc.yaml)."""

    verifier: Path
    prepared: Path
    hidden_states: Path
    vocab: Path
    out: Path
    metrics: Path
    live_dir: Path
    checkpoints: Path = CHECKPOINT_ROOT


def _lr_lambda(params: TrainParams):
    def factor(step: int) -> float:
        if step < params.warmup_steps:
            return (step + 1) / params.warmup_steps
        progress = (step - params.warmup_steps) / max(1, params.steps - params.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return params.min_lr_ratio + (1 - params.min_lr_ratio) * cosine

    return factor


def train_draft(params: TrainParams, inputs: TrainInputs) -> dict[str, Any]:
    """The train stage; returns the metrics it writes."""
    from dvclive import Live

    verifier, model_dir = load_verifier_info(inputs.verifier)
    vocab, d2t, t2d = load_vocab(inputs.vocab)
    dist, device = init_distributed(pick_device(params.device, "train.device"))
    runtime = draft_runtime(params, device)
    data = load_training_data(params, verifier, inputs.prepared, inputs.hidden_states, inputs.vocab, runtime.hs_dtype,
                              model_dir=model_dir, device=device)
    rows, lengths = data.rows, data.lengths
    model = build_draft(verifier, model_dir, params, vocab["draft_vocab_size"], d2t, t2d, runtime.attention)
    model = model.to(device)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=params.lr, weight_decay=params.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(params))

    fingerprint = run_fingerprint(params, verifier, inputs.prepared, inputs.vocab, inputs.hidden_states)
    checkpoint_path = inputs.checkpoints / fingerprint / CHECKPOINT_FILE
    start_step = resume(checkpoint_path, model, optimizer, scheduler, params.seed)
    if dist.is_main:
        if start_step:
            log.info("resuming run %s from step %d (%s)", fingerprint, start_step, checkpoint_path)
            trim_live_history(inputs.live_dir, start_step)
        elif inputs.live_dir.exists():
            shutil.rmtree(inputs.live_dir)
    dist.barrier()
    # Each process packs its own share of the rows; the global batch is world_size packed sequences.
    val_batches = pack_batches(rows["val"], lengths, params.total_seq_len, params.seed, epoch=0)
    my_rows = rows["train"][dist.rank :: dist.world_size]
    train_batches = PackedBatches(my_rows, lengths, params.total_seq_len, params.seed).from_step(start_step)
    network = (torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda"
                                                         else None) if dist.world_size > 1 else model)

    # dvclive step s holds what was measured after s optimizer steps (step 0: the untrained draft).
    live = (Live(dir=str(inputs.live_dir), dvcyaml=False, save_dvc_exp=False, resume=start_step > 0, report=None)
            if dist.is_main else None)

    def validate(step: int) -> dict[str, Any]:
        """Rank 0 validates on the unwrapped model (no collectives); the others wait."""
        result: dict[str, Any] = {}
        if live is not None:
            result = validate_draft(model, data, val_batches, runtime)
            _log_validation(live, step, result)
        dist.barrier()
        return result

    if start_step == 0:  # the curves start at the untrained draft, so progress shows
        validate(0)
    started = time.perf_counter()
    step_seconds = 0.0  # time in training steps only, validation and checkpoints excluded
    trained_tokens = 0.0
    train_loss = float("nan")
    validation: dict[str, Any] = {}
    for step in range(start_step, params.steps):
        step_started = time.perf_counter()
        batch_rows = next(train_batches)
        batch = data.batch(batch_rows, device, training=True)
        try:
            with runtime.autocast():
                _, loss, _ = network(**batch, **runtime.forward_kwargs)
            loss.backward()  # DDP averages the gradients over processes here
        except (torch.OutOfMemoryError, MemoryError):
            raise EaglenestError(
                f"out of memory on {device} for a batch of {params.total_seq_len} tokens x {params.ttt_steps} "
                f"TTT steps; lower train.total_seq_len or train.ttt_steps"
            ) from None
        if params.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(trainable, params.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        done = step + 1
        step_seconds += time.perf_counter() - step_started
        tokens = dist.sum(sum(lengths[r] for r in batch_rows))
        trained_tokens += tokens
        train_loss = dist.mean(loss.item())
        if not math.isfinite(train_loss):
            raise EaglenestError(f"training loss became {train_loss} at step {done}; lower train.lr ({params.lr})")
        if live is not None:
            live.step = done
            live.log_metric("train/loss", train_loss)
            live.log_metric("train/lr", scheduler.get_last_lr()[0])
            live.log_metric("train/tokens_per_s", tokens / (time.perf_counter() - step_started))
        if done % params.eval_every == 0 or done == params.steps:
            validation = validate(done)
        if done % params.checkpoint_every == 0 and done < params.steps:
            if dist.is_main:
                save_checkpoint(checkpoint_path, model, optimizer, scheduler, done)
            dist.barrier()
    seconds = time.perf_counter() - started

    metrics: dict[str, Any] = {}
    if live is not None:
        live.end()
        save_draft(model, inputs.out, params.verifier_name or verifier.name)
        metrics = {
            "steps": params.steps,
            "steps_this_run": params.steps - start_step,
            "resumed_from_step": start_step,
            "train_loss": round(train_loss, 6),
            "val_loss": round(validation["val_loss"], 6),
            "val_acc": [round(a, 6) for a in validation["val_acc"]],
            "val_cond_acc": [round(a, 6) for a in validation["val_cond_acc"]],
            # The same per TTT step under flat names: `dvc metrics diff` shows scalars only.
            **{f"val_acc_{i}": round(a, 6) for i, a in enumerate(validation["val_acc"])},
            "tau_sim": round(validation["tau_sim"], 4),
            # Real (unpadded) tokens per second of training steps; validation time is not counted.
            "tokens_per_s": round(trained_tokens / step_seconds, 1) if trained_tokens else None,
            "seconds": round(seconds, 3),
            "device": device.type,
            "precision": runtime.precision,
            "loss_tokens": params.loss_tokens,
            "processes": dist.world_size,
            "hidden_states": "online" if data.online is not None else "files",
            "train_rows": len(rows["train"]),
            "val_rows": len(rows["val"]),
            "split_train_rows": load_split(inputs.prepared)["train_rows"],
        }
        atomic_write_json(inputs.metrics, metrics)
        shutil.rmtree(checkpoint_path.parent, ignore_errors=True)  # finished: the draft itself is the result
    dist.barrier()
    return metrics


def _log_validation(live: Any, step: int, result: dict[str, Any]) -> None:
    """One validation's figures as dvclive metrics at ``step`` (and one log line)."""
    live.step = step
    live.log_metric("val/loss", result["val_loss"])
    for i, (full, cond) in enumerate(zip(result["val_acc"], result["val_cond_acc"], strict=True)):
        live.log_metric(f"val/acc_{i}", full)
        live.log_metric(f"val/cond_acc_{i}", cond)
    live.log_metric("val/tau_sim", result["tau_sim"])
    log.info("step %d: val loss %.4f, acc %s, tau_sim %.3f", step, result["val_loss"],
             [round(a, 3) for a in result["val_acc"]], result["tau_sim"])
