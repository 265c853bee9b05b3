"""One optimizer step, and what it needs: the optimizers over the draft's trainable weights (``train.optimizer``:
AdamW, or Muon and AdamW, built by speculators' ``build_optimizers``), each with linear warm-up and a cosine decay to
``train.min_lr_ratio``. The train stage's fit phase accumulates a step's share of the global batch with
:func:`backward` and steps with :func:`optimizer_step`; ``bench/`` steps one batch at a time with
:func:`train_step`, the same arithmetic, so a benchmark measures the stage's own."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from eaglenest.core.errors import EaglenestError
from eaglenest.stages.train.model import Runtime
from eaglenest.stages.train.params import TrainParams


@dataclass(frozen=True)
class Optimization:
    """The optimizers, their schedules and the weights they move.

    Attributes:
        trainable: The draft's parameters that train (embeddings, LM head and verifier norm are frozen, except
            P-EAGLE's embeddings).
        optimizers: ``[AdamW]`` for ``train.optimizer: adamw``; ``[Muon, AdamW]`` for ``muon`` (Muon over the 2-D
            weight matrices, AdamW over the rest), in speculators' order.
        schedulers: One per optimizer, in the same order, each with the factor of :func:`lr_factor` on its own
            peak learning rate.
    """

    trainable: list[torch.nn.Parameter]
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[torch.optim.lr_scheduler.LambdaLR]

    def learning_rates(self) -> dict[str, float]:
        """The learning rate each optimizer steps with next, under the curve name it is logged as: ``train/lr``
        (AdamW's, whatever ``train.optimizer``) and, with Muon, ``train/muon_lr`` (before torch's per-matrix
        ``adjust_lr_fn`` scaling)."""
        rates = {}
        for optimizer, scheduler in zip(self.optimizers, self.schedulers, strict=True):
            name = "train/muon_lr" if isinstance(optimizer, torch.optim.Muon) else "train/lr"
            rates[name] = scheduler.get_last_lr()[0]
        return rates


@dataclass(frozen=True)
class OptimizerConfig:
    """What speculators' ``build_optimizers`` reads of its ``TrainerConfig``: the optimizer and its knobs, from
    ``train.optimizer``, ``train.lr``, ``train.weight_decay`` and ``train.muon``."""

    optimizer: Literal["adamw", "muon"]
    lr: float
    weight_decay: float
    muon_lr: float
    muon_momentum: float
    muon_weight_decay: float
    muon_ns_steps: int
    muon_adjust_lr_fn: Literal["match_rms_adamw", "original"]

    @classmethod
    def of(cls, params: TrainParams) -> OptimizerConfig:
        """The train params' optimizer settings (speculators' Muon defaults where ``train.muon`` is null)."""
        muon = params.muon_settings
        return cls(
            optimizer=params.optimizer,
            lr=params.lr,
            weight_decay=params.weight_decay,
            muon_lr=muon.lr,
            muon_momentum=muon.momentum,
            muon_weight_decay=muon.weight_decay,
            muon_ns_steps=muon.ns_steps,
            muon_adjust_lr_fn=muon.adjust_lr_fn,
        )


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
    """``train.optimizer``'s optimizers over ``model``'s trainable parameters, by speculators' ``build_optimizers``,
    and a schedule for each.

    ``model`` is the draft itself, not its DDP wrapper: the optimizers step the same tensors either way, and the
    names speculators matches (``embed_tokens``, ``lm_head``) stay the draft's own. For ``adamw`` speculators hands
    AdamW every parameter, frozen ones included; AdamW skips a parameter without a gradient (no update, no state,
    no weight decay), so only the trainable weights move, as ``trainable`` (what the gradient is clipped over)
    lists them. Muon's split skips frozen parameters itself.
    """
    from speculators.train.optimizers import build_optimizers

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizers = build_optimizers(model, OptimizerConfig.of(params))
    schedulers = [torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(params)) for optimizer in optimizers]
    return Optimization(trainable, optimizers, schedulers)


def train_step(
    network: Any, batch: dict[str, Any], runtime: Runtime, optimization: Optimization, params: TrainParams
) -> float:
    """One optimizer step on one packed batch: :func:`backward`, then :func:`optimizer_step`.

    Returns:
        The batch's loss.
    """
    loss = backward(network, batch, runtime, params)
    optimizer_step(optimization, params)
    return loss


def backward(
    network: Any, batch: dict[str, Any], runtime: Runtime, params: TrainParams, share: int = 1, sync: bool = True
) -> float:
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
    """Gradient clipping over every trainable weight (``train.grad_clip``), one step of each optimizer and its
    schedule, gradients cleared."""
    if params.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(optimization.trainable, params.grad_clip)
    for optimizer in optimization.optimizers:
        optimizer.step()
    for scheduler in optimization.schedulers:
        scheduler.step()
    for optimizer in optimization.optimizers:
        optimizer.zero_grad(set_to_none=True)
