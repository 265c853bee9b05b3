"""The k_sweep stage's figures: each speed-up over the plain engine timed beside it, with its 95% interval, and the
K chosen from them. Pure arithmetic over the timed turns, so it is tested without an engine.

A timed entry is ``{"turns": [[tokens, seconds], ...], "plain_turns": [[tokens, seconds], ...], ...}``: turn i
of both is the same prompt, decoded moments apart, so turns are resampled in pairs.
"""

from __future__ import annotations

import statistics
from typing import Any

from eaglenest.core.measure.speedup import paired_rows, speedup_interval


def speedup(entries: list[dict[str, Any]], samples: int, seed: int) -> tuple[float, float]:
    """The speed-up over all turns of ``entries`` pooled (tokens/s over the plain engine's) and half its 95%
    interval's width."""
    rows = paired_rows([t for e in entries for t in e["turns"]], [t for e in entries for t in e["plain_turns"]])
    interval = speedup_interval(rows, samples, seed)
    return round(interval.value, 3), round(interval.half_width, 3)


def add_speedup(entry: dict[str, Any], samples: int, seed: int) -> None:
    """One set's speed-up at one K, with its 95% interval over its turns, into ``entry``."""
    entry["speedup"], entry["speedup_ci95"] = speedup([entry], samples, seed)


def best_ks(rounds: list[dict[str, Any]], set_names: list[str], ks: list[int], drafters: list[str]
            ) -> dict[str, Any]:
    """Per set and drafter, the K with the best mean speed-up over rounds (ties: the smaller K, the cheaper step).

    Returns:
        ``{set: {drafter: {k, mean_speedup, mean_speedup_per_k}}}``.
    """
    best: dict[str, Any] = {}
    for name in set_names:
        best[name] = {}
        for drafter in drafters:
            per_k = {k: statistics.mean(r[drafter][str(k)][name]["speedup"] for r in rounds) for k in ks}
            k_best = max(ks, key=lambda k, per_k=per_k: (per_k[k], -k))
            best[name][drafter] = {"k": k_best, "mean_speedup": round(per_k[k_best], 3),
                                   "mean_speedup_per_k": {str(k): round(v, 3) for k, v in per_k.items()}}
    return best


def serve_k(rounds: list[dict[str, Any]], set_names: list[str], ks: list[int], samples: int, seed: int
            ) -> tuple[int, float, float]:
    """The K to serve the draft at: the best speed-up over every headline set's timed turns of every round,
    pooled (ties: the smaller K); with that speed-up and half its 95% interval's width."""
    pooled = {k: speedup([r["draft"][str(k)][name] for r in rounds for name in set_names], samples, seed)
              for k in ks}
    k_best = max(ks, key=lambda k: (pooled[k][0], -k))
    return k_best, *pooled[k_best]
