"""The lossless rule for one output: where a speculative output first leaves plain decoding, and whether that
is a flipped near-tie.

Speculative decoding with greedy verification must emit exactly the tokens of plain greedy decoding. That
holds bit for bit only where the verify forward over K+1 positions computes the same argmax as K+1
one-token forwards, which float32 does and lower precision does not quite (see :mod:`eaglenest.stages.evaluate`
for the rule each back end applies). Shared by the evaluate stage (:mod:`eaglenest.stages.evaluate.lossless`)
and ``eaglenest bench``, so both judge a difference alike.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Divergence:
    """Where a speculative output first leaves plain decoding.

    Attributes:
        position: Index of the first differing output token.
        plain_token: Plain decoding's token there; None where plain output had already ended.
        spec_token: Speculative decoding's token there; None where it had already ended.
        gap: The plain run's top log-prob minus its log-prob of ``spec_token`` there; None when
            ``spec_token`` is not among the recorded candidates (or none were recorded).
        spec_rank: ``spec_token``'s rank among the plain run's candidates there (1 = its second choice).
    """

    position: int
    plain_token: int | None
    spec_token: int | None
    gap: float | None
    spec_rank: int | None

    def is_near_tie(self, margin: float) -> bool:
        """The below-float32 rule: speculation took one of plain's top candidates, within ``margin`` of its
        best."""
        return self.gap is not None and self.gap <= margin


# How many of the plain run's best tokens are recorded per position: enough for a three-way near-tie.
TIE_CANDIDATES = 5
# One entry per plain output token: the plain run's top candidates, best first, as (token id, log-prob).
TopCandidates = list[tuple[int, float]]


def first_divergence(
    plain: list[int], spec: list[int], plain_top: list[TopCandidates] | None = None
) -> Divergence | None:
    """The first position where ``spec`` differs from ``plain``; None when the two are identical.

    Args:
        plain: Plain decoding's output token ids.
        spec: Speculative decoding's output token ids for the same prompt.
        plain_top: The plain run's top candidates (token, log-prob) at every output position, if recorded.
    """
    if plain == spec:
        return None
    position = next(
        (i for i, (a, b) in enumerate(zip(plain, spec, strict=False)) if a != b), min(len(plain), len(spec))
    )
    plain_token = plain[position] if position < len(plain) else None
    spec_token = spec[position] if position < len(spec) else None
    top = plain_top[position] if plain_top is not None and position < len(plain_top) else []
    ranks = {token: rank for rank, (token, _) in enumerate(top)}
    if plain_token is None or spec_token not in ranks:
        # One output ended where the other went on, or speculation emitted a token plain decoding did not
        # even consider: not a flipped near-tie.
        return Divergence(position, plain_token, spec_token, None, None)
    rank = ranks[spec_token]
    return Divergence(position, plain_token, spec_token, round(top[0][1] - top[rank][1], 6), rank)


def is_lossless(divergence: Divergence | None, tie_margin: float | None) -> bool:
    """The rule for one output: identical to plain decoding, or, below float32 (``tie_margin`` set), parted from
    it at a flipped near-tie within the margin."""
    return divergence is None or (tie_margin is not None and divergence.is_near_tie(tie_margin))
