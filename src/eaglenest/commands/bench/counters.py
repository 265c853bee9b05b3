"""Speculative decoding's acceptance between two ``/metrics`` readings of a server, and where a run's counters
disagree with its responses. The counters themselves, their names and their parser are the measurement kit's
(:mod:`eaglenest.core.measure.spec_counters`), which evaluate reads from its engines too."""

from __future__ import annotations

from typing import Any

from eaglenest.core.measure.spec_counters import GENERATION_TOKENS, REQUEST_SUCCESS, MetricsReading, SpecCounts


def acceptance(before: MetricsReading, after: MetricsReading) -> SpecCounts | None:
    """Speculative decoding over the requests between two readings; None without spec-decode counters."""
    if before.spec is None or after.spec is None:
        return None
    return after.spec - before.spec


def acceptance_json(spec: SpecCounts) -> dict[str, Any]:
    """The figures as bench.json records them: tau = 1 + accepted / drafts and the per-position acceptance
    (accepted at position i / drafts), None without a draft, with the counts they come from."""
    drafts = spec.drafts
    return {
        "tau": round(spec.tau, 4) if spec.tau is not None else None,
        "per_position_acceptance": [round(n / drafts, 4) for n in spec.per_position] if drafts > 0 else None,
        "drafts": drafts,
        "draft_tokens": spec.draft_tokens,
        "accepted_tokens": spec.accepted,
        "accepted_per_position": spec.per_position,
    }


def counter_problems(
    before: MetricsReading, after: MetricsReading, spec: SpecCounts | None, raw: dict[str, Any], spec_expected: bool
) -> list[str]:
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
            problems.append(
                f"{GENERATION_TOKENS} grew by {int(generated)}, the responses hold "
                f"{raw.get('total_output_tokens')} tokens (other traffic on the server?)"
            )
    if REQUEST_SUCCESS in after.totals:
        finished = after.totals[REQUEST_SUCCESS] - before.totals.get(REQUEST_SUCCESS, 0.0)
        if int(finished) != int(raw.get("completed", -1)):
            problems.append(f"{REQUEST_SUCCESS} grew by {int(finished)}, {raw.get('completed')} requests completed")
    if spec is None:
        return problems
    if spec_expected and spec.drafts == 0 and raw.get("total_output_tokens", 0) > raw.get("completed", 0):
        problems.append("no drafts during the run: is speculative decoding on?")
    problems += spec.problems()
    theirs = raw.get("spec_decode_acceptance_length")
    if spec.tau is not None and (theirs is None or abs(float(theirs) - spec.tau) > 1e-3):
        problems.append(f"tau {round(spec.tau, 4)} from /metrics, vLLM's bench read {theirs}")
    return problems
