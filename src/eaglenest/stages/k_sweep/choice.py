"""The k_sweep stage's choice: the K chosen from the speed-ups timed beside the plain engine (timed entries of
:mod:`eaglenest.core.measure.beside_plain`). Pure arithmetic over the timed turns, so it is tested without an
engine."""

from __future__ import annotations

import statistics
from typing import Any

from eaglenest.core.measure.beside_plain import pooled_speedup


def best_ks(rounds: list[dict[str, Any]], set_names: list[str], ks: list[int], drafters: list[str]) -> dict[str, Any]:
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
            best[name][drafter] = {
                "k": k_best,
                "mean_speedup": round(per_k[k_best], 3),
                "mean_speedup_per_k": {str(k): round(v, 3) for k, v in per_k.items()},
            }
    return best


def serve_k(
    rounds: list[dict[str, Any]], set_names: list[str], ks: list[int], samples: int, seed: int
) -> tuple[int, float, float, str]:
    """The K to serve the draft at, over every headline set's timed turns of every round, pooled: the smallest K
    whose speed-up's 95% interval reaches the fastest K's (a smaller K drafts less per step, so where the timing
    cannot tell them apart the cheaper one stands, and the choice does not flip between runs on noise); with its
    speed-up, half its interval's width, and why, in words."""
    pooled = {
        k: pooled_speedup([r["draft"][str(k)][name] for r in rounds for name in set_names], samples, seed) for k in ks
    }
    fastest = max(ks, key=lambda k: (pooled[k][0], -k))
    value, half = pooled[fastest]
    chosen = min(k for k in ks if pooled[k][0] + pooled[k][1] >= value - half)
    if chosen == fastest:
        why = f"K {fastest} was fastest (x{value:.3f} ± {half:.3f}) and no smaller K's interval reaches it"
    else:
        why = (
            f"K {fastest} was fastest (x{value:.3f} ± {half:.3f}), and K {chosen}'s interval "
            f"(x{pooled[chosen][0]:.3f} ± {pooled[chosen][1]:.3f}) overlaps it: the smaller K, the cheaper step, stands"
        )
    return chosen, *pooled[chosen], why
