"""A server's ``/metrics`` counters, and speculative decoding's acceptance between two readings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eaglenest.core.errors import EaglenestError
from eaglenest.core.vllm_metrics import ACCEPTED, ACCEPTED_PER_POS, DRAFT_TOKENS, DRAFTS

GENERATION_TOKENS = "vllm:generation_tokens"


REQUEST_SUCCESS = "vllm:request_success"


@dataclass(frozen=True)
class Counters:
    """The counters of one ``/metrics`` reading, each summed over its label sets (engines).

    Attributes:
        totals: Counter family name -> value.
        accepted_per_pos: Draft position -> accepted tokens there.
    """

    totals: dict[str, float]
    accepted_per_pos: dict[int, float]

    @property
    def has_spec_decode(self) -> bool:
        return DRAFTS in self.totals and ACCEPTED in self.totals


def parse_metrics(text: str, where: str) -> Counters:
    """The counters of a Prometheus text exposition.

    Only the ``_total`` samples are summed: prometheus_client also exposes ``_created`` timestamps.

    Raises:
        EaglenestError: text the parser refuses (naming ``where``).
    """
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            if family.type != "counter":
                continue
            for sample in family.samples:
                if not sample.name.endswith("_total"):
                    continue
                totals[family.name] = totals.get(family.name, 0.0) + sample.value
                if family.name == ACCEPTED_PER_POS and "position" in sample.labels:
                    position = int(sample.labels["position"])
                    per_pos[position] = per_pos.get(position, 0.0) + sample.value
    except ValueError as err:
        raise EaglenestError(f"{where}: not Prometheus text ({err}); is it a vLLM server?") from None
    return Counters(totals, per_pos)


@dataclass(frozen=True)
class Acceptance:
    """Speculative decoding over the requests between two readings, as vLLM defines it.

    Attributes:
        drafts: Draft proposals (verify steps that drafted).
        draft_tokens: Tokens drafted.
        accepted_tokens: Draft tokens the verifier accepted.
        accepted_per_position: Accepted tokens at each draft position (a chain's position i only after i-1).
    """

    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int]

    @property
    def tau(self) -> float | None:
        """Tokens per verifier step, 1 + accepted / drafts; None without a draft."""
        return round(1 + self.accepted_tokens / self.drafts, 4) if self.drafts > 0 else None

    @property
    def per_position_acceptance(self) -> list[float] | None:
        """Accepted at position i / drafts; None without a draft."""
        return [round(n / self.drafts, 4) for n in self.accepted_per_position] if self.drafts > 0 else None

    def as_json(self) -> dict[str, Any]:
        """The figures as bench.json records them."""
        return {"tau": self.tau, "per_position_acceptance": self.per_position_acceptance, "drafts": self.drafts,
                "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "accepted_per_position": self.accepted_per_position}


def acceptance(before: Counters, after: Counters) -> Acceptance | None:
    """Speculative decoding over the requests between two readings; None without spec-decode counters."""
    if not (before.has_spec_decode and after.has_spec_decode):
        return None
    drafts = after.totals[DRAFTS] - before.totals[DRAFTS]
    accepted = after.totals[ACCEPTED] - before.totals[ACCEPTED]
    draft_tokens = after.totals.get(DRAFT_TOKENS, 0.0) - before.totals.get(DRAFT_TOKENS, 0.0)
    positions = sorted(set(before.accepted_per_pos) | set(after.accepted_per_pos))
    per_pos = [int(after.accepted_per_pos.get(p, 0.0) - before.accepted_per_pos.get(p, 0.0)) for p in positions]
    return Acceptance(int(drafts), int(draft_tokens), int(accepted), per_pos)


def counter_problems(before: Counters, after: Counters, spec: Acceptance | None, raw: dict[str, Any],
                     spec_expected: bool) -> list[str]:
    """Where a run's counters disagree with its responses or with vLLM's own reading of them; [] when none.

    Args:
        before: The reading before the run.
        after: The reading after it.
        spec: :func:`acceptance` of the two.
        raw: ``vllm bench serve``'s result of the run.
        spec_expected: The endpoint serves a draft (every decode step drafts).
    """
    problems = []
    if GENERATION_TOKENS in after.totals:
        generated = after.totals[GENERATION_TOKENS] - before.totals.get(GENERATION_TOKENS, 0.0)
        if int(generated) != int(raw.get("total_output_tokens", -1)):
            problems.append(f"{GENERATION_TOKENS} grew by {int(generated)}, the responses hold "
                            f"{raw.get('total_output_tokens')} tokens (other traffic on the server?)")
    if REQUEST_SUCCESS in after.totals:
        finished = after.totals[REQUEST_SUCCESS] - before.totals.get(REQUEST_SUCCESS, 0.0)
        if int(finished) != int(raw.get("completed", -1)):
            problems.append(f"{REQUEST_SUCCESS} grew by {int(finished)}, {raw.get('completed')} requests completed")
    if spec is None:
        return problems
    if spec_expected and spec.drafts == 0 and raw.get("total_output_tokens", 0) > raw.get("completed", 0):
        problems.append("no drafts during the run: is speculative decoding on?")
    if spec.accepted_tokens > spec.draft_tokens:
        problems.append(f"{spec.accepted_tokens} tokens accepted of {spec.draft_tokens} drafted")
    per_pos = spec.accepted_per_position
    if per_pos and sum(per_pos) != spec.accepted_tokens:
        problems.append(f"the accepted tokens per position sum to {sum(per_pos)}, not {spec.accepted_tokens}")
    # a chain draft's token i is accepted only after token i-1 was
    if any(later > earlier for earlier, later in zip(per_pos, per_pos[1:], strict=False)):
        problems.append(f"accepted tokens per position rise with the position: {per_pos}")
    theirs = raw.get("spec_decode_acceptance_length")
    if spec.tau is not None and (theirs is None or abs(float(theirs) - spec.tau) > 1e-3):
        problems.append(f"tau {spec.tau} from /metrics, vLLM's bench read {theirs}")
    return problems
