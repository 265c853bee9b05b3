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


def _ratio(sums: dict[str, float], name: str) -> float:
    return sums[f"{name}_sum"] / max(sums[f"{name}_total"], 1)


def accuracies(algorithm: str, sums: dict[str, float], k: int) -> tuple[list[float], list[float], float]:
    """(accuracy per drafted position, conditional accuracy per position, tau_sim) from speculators' metric sums.

    * eagle3: step i's accuracy, and its accuracy where steps before it were right; tau_sim chains the latter.
    * peagle: depth d's accuracy, each depth predicted from the true prefix; no conditional figure, so tau_sim
      chains the plain accuracies, as if positions were independent (an estimate, below the chained one where
      right guesses come together).
    * dflash: the accuracy of a block's drafted positions 1..K; tau_sim is speculators' own accepted length per
      block (the leading run of right positions plus the verifier's bonus token), conditional by construction.
    """
    if algorithm == "eagle3":
        full = [_ratio(sums, f"full_acc_{i}") for i in range(k)]
        cond = [_ratio(sums, f"cond_acc_{i}") for i in range(k)]
        return full, cond, tau_from_conditional(cond)
    if algorithm == "peagle":
        full = [_ratio(sums, f"position_{d}_acc") for d in range(k)]
        return full, [], tau_from_conditional(full)
    full = [_ratio(sums, f"position_{position}_acc") for position in range(1, k + 1)]
    return full, [], _ratio(sums, "eal")


def validate_draft(model: Any, data: TrainingData, batches: list[list[int]], runtime: Runtime) -> dict[str, Any]:
    """In-training validation: loss and per-position full (and, for eagle3, conditional) accuracy over the
    validation ``batches``, and tau_sim from them. (The evaluate stage measures the draft in real decoding.)"""
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
    full, cond, tau_sim = accuracies(runtime.algorithm, sums, runtime.ttt_steps)
    return {"val_loss": sum(losses) / len(losses), "val_acc": full, "val_cond_acc": cond, "tau_sim": tau_sim}
