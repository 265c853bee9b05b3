"""In-training validation: the draft's loss and accuracy on the held-out rows, and the tau they imply."""

from __future__ import annotations

from typing import Any

import torch

from eaglenest.stages.train.data import TrainingData
from eaglenest.stages.train.model import Runtime


def tau_from_conditional(cond_acc: list[float]) -> float:
    """Simulated acceptance length: 1 + a0 + a0*a1 + ... (a_i = P(step i right | steps before right))."""
    tau, prefix = 1.0, 1.0
    for accuracy in cond_acc:
        prefix *= accuracy
        tau += prefix
    return tau


def validate_draft(model: Any, data: TrainingData, batches: list[list[int]], runtime: Runtime) -> dict[str, Any]:
    """In-training validation: loss and per-TTT-step full / conditional accuracy over the validation
    ``batches``, and tau_sim from them. (The evaluate stage measures the draft in real decoding.)"""
    sums: dict[str, float] = {}
    losses = []
    model.eval()
    with torch.no_grad(), runtime.autocast():
        for batch_rows in batches:
            _, loss, metrics = runtime.forward(model, data.batch(batch_rows, runtime.device))
            losses.append(loss.item())
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value)
    model.train()
    ttt_steps = runtime.ttt_steps
    full = [sums[f"full_acc_{i}_sum"] / max(sums[f"full_acc_{i}_total"], 1) for i in range(ttt_steps)]
    cond = [sums[f"cond_acc_{i}_sum"] / max(sums[f"cond_acc_{i}_total"], 1) for i in range(ttt_steps)]
    return {"val_loss": sum(losses) / len(losses), "val_acc": full, "val_cond_acc": cond,
            "tau_sim": tau_from_conditional(cond)}
