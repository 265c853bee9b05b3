"""When is speculative decoding lossless? The rule per back end and dtype, applied to decoded tokens.

Speculative decoding with greedy verification must emit exactly the tokens of plain greedy decoding. That
holds bit for bit only where the verify forward over K+1 positions computes the same argmax as K+1
one-token forwards, which float32 does and lower precision does not quite (see :mod:`eaglenest.stages.evaluate`
for the rule each back end applies). The rule for one output is :mod:`eaglenest.core.lossless_rule`'s
(shared with ``eaglenest bench``); this module counts it over a set. The back ends supply tokens.
"""

from __future__ import annotations

from typing import Any

# The rule for one output lives in core, where eaglenest bench reads it too; its names stay importable here.
from eaglenest.core.lossless_rule import TIE_CANDIDATES, Divergence, TopCandidates, first_divergence, is_lossless

__all__ = ["TIE_CANDIDATES", "Divergence", "TopCandidates", "first_divergence", "is_lossless", "lossless_counts"]


def lossless_counts(
    plains: list[list[int]],
    specs: list[list[int]],
    plain_tops: list[list[TopCandidates]] | None,
    tie_margin: float | None,
) -> dict[str, Any]:
    """identical_fraction, lossless_fraction and the divergences behind them (see the module docstring).

    Args:
        plains: Plain outputs, one per prompt.
        specs: Speculative outputs of the same prompts, same order.
        plain_tops: The plain run's top candidates per output position, per prompt; needed for the tie rule.
        tie_margin: None for the exact rule (float32); else the largest top-2 log-prob gap a flipped
            near-tie may have (``evaluate.bf16_tie_margin``).
    """
    divergences = [
        first_divergence(p, s, plain_tops[i] if plain_tops is not None else None)
        for i, (p, s) in enumerate(zip(plains, specs, strict=True))
    ]
    identical = sum(d is None for d in divergences)
    lossless = sum(is_lossless(d, tie_margin) for d in divergences)
    return {
        "identical_fraction": round(identical / len(plains), 4),
        "lossless_fraction": round(lossless / len(plains), 4),
        # Where outputs parted, how far below plain's best the emitted token was (null: not among plain's
        # top candidates): what evaluate.bf16_tie_margin is judged against.
        "divergence_gaps": [d.gap for d in divergences if d is not None],
    }
