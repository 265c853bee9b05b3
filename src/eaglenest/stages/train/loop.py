"""One optimizer step, and what it needs: AdamW over the draft's trainable weights, with linear warm-up and a
cosine decay to ``train.min_lr_ratio``. The train stage's fit phase accumulates a step's share of the global batch
with :func:`backward` and steps with :func:`optimizer_step`; ``bench/`` steps one batch at a time with
:func:`train_step`, the same arithmetic, so a benchmark measures the stage's own."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from eaglenest.core.errors import EaglenestError
from eaglenest.stages.train.model import Runtime
from eaglenest.stages.train.params import TrainParams


@dataclass(frozen=True)
class Optimization:
    """The optimizer, its schedule and the weights it moves.

    Attributes:
        trainable: The draft's parameters that train (embeddings, LM head and verifier norm are frozen).
        optimizer: AdamW over ``trainable``.
        scheduler: Per-step learning-rate factor (:func:`lr_factor`).
    """

    trainable: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR


def lr_factor(params: TrainParams) -> Callable[[int], float]:
    """Step -> learning-rate multiplier: linear warm-up over ``warmup_steps``, then cosine to ``min_lr_ratio``."""

    def factor(step: int) -> float:
        if step < params.warmup_steps:
            return (step + 1) / params.warmup_steps
        progress = (step - params.warmup_steps) / max(1, params.steps - params.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return params.min_lr_ratio + (1 - params.min_lr_ratio) * cosine

    return factor


def build_optimization(model: Any, params: TrainParams) -> Optimization:
    """AdamW and its schedule over ``model``'s trainable parameters."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=params.lr, weight_decay=params.weight_decay)
    return Optimization(trainable, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(params)))


def train_step(network: Any, batch: dict[str, Any], runtime: Runtime, optimization: Optimization,
               params: TrainParams) -> float:
    """One optimizer step on one packed batch: :func:`backward`, then :func:`optimizer_step`.

    Returns:
        The batch's loss.
    """
    loss = backward(network, batch, runtime, params)
    optimizer_step(optimization, params)
    return loss


def backward(network: Any, batch: dict[str, Any], runtime: Runtime, params: TrainParams, share: int = 1,
             sync: bool = True) -> float:
    """Forward and backward of one packed batch, its gradients added to those already accumulated.

    Args:
        network: The draft, or its DDP wrapper (which averages the gradients over processes in the backward it
            syncs).
        batch: The packed model inputs (``TrainingData.batch``).
        runtime: How the draft runs on this device.
        params: The train params (named in the out-of-memory message).
        share: The batches this process accumulates for the step: each loss counts 1 / share, so the step's
            gradient is the mean over the global batch whatever the number of processes.
        sync: Whether DDP averages the gradients over processes in this backward (the step's last batch); the
            others run under ``no_sync``.

    Returns:
        The batch's loss (unscaled).
    """
    accumulate = network.no_sync() if not sync and hasattr(network, "no_sync") else contextlib.nullcontext()
    try:
        with accumulate:
            with runtime.autocast():
                _, loss, _ = runtime.forward(network, batch)
            (loss / share if share > 1 else loss).backward()
    except (torch.OutOfMemoryError, MemoryError):
        raise EaglenestError(
            f"out of memory on {runtime.device} for a batch of {params.total_seq_len} tokens x {params.ttt_steps} "
            f"TTT steps; lower train.total_seq_len or train.ttt_steps"
        ) from None
    return loss.item()


def optimizer_step(optimization: Optimization, params: TrainParams) -> None:
    """Gradient clipping (``train.grad_clip``), one optimizer and schedule step, gradients cleared."""
    if params.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(optimization.trainable, params.grad_clip)
    optimization.optimizer.step()
    optimization.scheduler.step()
    optimization.optimizer.zero_grad(set_to_none=True)
