"""Acceptance counts: one type for every drafter and back end (hf EAGLE-3, vLLM's EAGLE-3, n-gram).

A speculative decoding is a sequence of verify steps. In each, the drafter proposes up to K tokens, the
verifier accepts a prefix of them, and emits one token of its own. Summed over the prompts of a set:

* ``tau`` = 1 + accepted / steps — tokens emitted per verifier forward, vLLM's "mean acceptance length";
* ``per_position_acceptance[i]`` = (steps whose draft i+1 was accepted) / steps;
* ``draft_acceptance_rate`` = accepted / drafted — drafted counts the tokens actually proposed, so a step
  that proposed fewer than K (n-gram without a match) is not charged for tokens it never drafted.

vLLM's counters (``spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens``,
``..._per_pos``) are exactly these four fields, so both back ends report through the same formulas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Acceptance:
    """Counts of one or more speculative decodings with K drafts per step.

    Attributes:
        k: Drafts per step (the most a step can accept).
        steps: Verify steps (one verifier forward each).
        drafted: Draft tokens proposed, over all steps.
        accepted: Draft tokens accepted, over all steps.
        per_position: ``[k]``: steps whose i-th draft was accepted (so it sums to ``accepted``).
    """

    k: int
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.per_position = (list(self.per_position) + [0] * self.k)[: max(self.k, len(self.per_position))]

    def add_step(self, drafted: int, accepted: int) -> None:
        """Records one verify step that proposed ``drafted`` tokens and accepted the first ``accepted``."""
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        for i in range(accepted):
            self.per_position[i] += 1

    def __add__(self, other: Acceptance) -> Acceptance:
        """The counts of both decodings (a set's total is the sum over its prompts)."""
        if other.k != self.k:
            raise ValueError(f"cannot add acceptance counts for K = {self.k} and K = {other.k}")
        return Acceptance(
            self.k,
            self.steps + other.steps,
            self.drafted + other.drafted,
            self.accepted + other.accepted,
            [a + b for a, b in zip(self.per_position, other.per_position, strict=True)],
        )

    @property
    def tau(self) -> float:
        """Tokens per verify step, 1 + accepted / steps (1.0 before any step)."""
        return 1 + self.accepted / self.steps if self.steps else 1.0

    def summary(self) -> dict[str, Any]:
        """The figures ``metrics/eval.json`` reports, rounded to 4 places."""
        steps = self.steps
        return {
            "tau": round(self.tau, 4),
            "per_position_acceptance": [round(c / steps, 4) if steps else 0.0 for c in self.per_position[: self.k]],
            "draft_acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
            "verify_steps": steps,
        }


def total(counts: list[Acceptance], k: int) -> Acceptance:
    """The sum of ``counts`` (an empty list is zero counts for K = ``k``)."""
    result = Acceptance(k)
    for count in counts:
        result = result + count
    return result
