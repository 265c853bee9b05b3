"""vLLM's speculative-decoding counters: one list of names, read from an engine (``llm.get_metrics()``), from a
server's ``/metrics`` text and from one request's own counts, as :class:`SpecCounts`.

vLLM defines them in ``vllm/v1/spec_decode/metrics.py`` (and ``vllm/v1/metrics/loggers.py``); these are the family
names, as ``get_metrics()`` and prometheus_client's parser give them, without the ``_total`` of their samples. An
engine started with ``disable_log_stats=False`` registers them in the process's prometheus registry, which is what a
server's ``/metrics`` renders, so all three readings count the same steps. Nothing here imports vLLM.

tau = 1 + accepted / drafts (a draft is one verify step that drafted): vLLM's mean acceptance length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eaglenest.core.errors import EaglenestError

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
GENERATION_TOKENS = "vllm:generation_tokens"
REQUEST_SUCCESS = "vllm:request_success"
_SCALARS = {DRAFTS: "drafts", DRAFT_TOKENS: "draft_tokens", ACCEPTED: "accepted"}


@dataclass(frozen=True)
class SpecCounts:
    """Speculative decoding's counts: one reading of the counters, or what the requests between two added.

    Attributes:
        drafts: Verify steps that drafted.
        draft_tokens: Tokens drafted.
        accepted: Draft tokens the verifier accepted.
        per_position: Accepted tokens at each draft position (a chain's position i only after i-1).
    """

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_position: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float | None:
        """Tokens per verify step, 1 + accepted / drafts; None without a draft."""
        return 1 + self.accepted / self.drafts if self.drafts > 0 else None

    def __sub__(self, before: SpecCounts) -> SpecCounts:
        """What the requests between ``before`` and this reading added (positions padded with zeros)."""
        size = max(len(self.per_position), len(before.per_position))
        after_pos = self.per_position + [0] * (size - len(self.per_position))
        before_pos = before.per_position + [0] * (size - len(before.per_position))
        return SpecCounts(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted - before.accepted,
            [a - b for a, b in zip(after_pos, before_pos, strict=True)],
        )

    def __add__(self, other: SpecCounts) -> SpecCounts:
        size = max(len(self.per_position), len(other.per_position))
        mine = self.per_position + [0] * (size - len(self.per_position))
        theirs = other.per_position + [0] * (size - len(other.per_position))
        return SpecCounts(
            self.drafts + other.drafts,
            self.draft_tokens + other.draft_tokens,
            self.accepted + other.accepted,
            [a + b for a, b in zip(mine, theirs, strict=True)],
        )

    def problems(self, k: int | None = None) -> list[str]:
        """Why these counts cannot describe speculative decoding with K = ``k`` drafts per step (any K when None);
        [] when they can."""
        problems = []
        if sum(self.per_position) != self.accepted and self.per_position:
            problems.append(
                f"{ACCEPTED_PER_POS} sums to {sum(self.per_position)}, but {ACCEPTED} grew by {self.accepted}"
            )
        if k is not None and len(self.per_position) > k:
            problems.append(f"{ACCEPTED_PER_POS} has {len(self.per_position)} positions for K = {k}")
        if self.accepted > self.draft_tokens:
            problems.append(f"{self.accepted} tokens accepted of {self.draft_tokens} drafted")
        # a chain draft's token i is accepted only after token i-1 was
        if any(later > earlier for earlier, later in zip(self.per_position, self.per_position[1:], strict=False)):
            problems.append(f"accepted tokens per position rise with the position: {self.per_position}")
        if k is not None and self.tau is not None and self.tau > k + 1:
            problems.append(f"tau = 1 + {self.accepted}/{self.drafts} exceeds K+1 = {k + 1}")
        return problems


def engine_counts(metrics: list[Any]) -> SpecCounts:
    """The counters of an engine's ``llm.get_metrics()`` snapshot, summed over its engines."""
    totals = dict.fromkeys(_SCALARS.values(), 0)
    per_position: list[int] = []
    for metric in metrics:
        if metric.name in _SCALARS:
            totals[_SCALARS[metric.name]] += int(metric.value)
        elif metric.name == ACCEPTED_PER_POS:
            per_position = (
                SpecCounts(per_position=per_position) + SpecCounts(per_position=[int(v) for v in metric.values])
            ).per_position
    return SpecCounts(per_position=per_position, **totals)


@dataclass(frozen=True)
class MetricsReading:
    """One ``/metrics`` reading: every counter family's total, summed over its label sets (engines).

    Attributes:
        totals: Counter family name -> value.
        accepted_per_pos: Draft position -> accepted tokens there.
    """

    totals: dict[str, float]
    accepted_per_pos: dict[int, float]

    @property
    def spec(self) -> SpecCounts | None:
        """The spec-decode counters of the reading; None where the server has none (no draft)."""
        if not (DRAFTS in self.totals and ACCEPTED in self.totals):
            return None
        positions = range(max(self.accepted_per_pos) + 1) if self.accepted_per_pos else range(0)
        return SpecCounts(
            int(self.totals[DRAFTS]),
            int(self.totals.get(DRAFT_TOKENS, 0.0)),
            int(self.totals[ACCEPTED]),
            [int(self.accepted_per_pos.get(p, 0.0)) for p in positions],
        )


def parse_metrics(text: str, where: str) -> MetricsReading:
    """The counters of a Prometheus text exposition (a server's ``/metrics``).

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
    return MetricsReading(totals, per_pos)


def request_counts(output: Any, k: int | None = None) -> SpecCounts | None:
    """One request's counts from vLLM's per-request ``spec_decode_metrics`` (engines started with
    ``per_request_spec_decode_metrics="summary"``), per position up to K = ``k`` (None: the histogram's K); None
    where the build reports none.

    Its histogram counts verify steps by accepted drafts ``j``; the per-position counts follow from it: a step that
    accepted ``j`` drafts accepted positions 1..j.
    """
    metrics = getattr(output.outputs[0], "spec_decode_metrics", None)
    if metrics is None:
        return None
    histogram = list(metrics.histogram)  # [K + 1]
    positions = len(histogram) - 1 if k is None else k
    per_position = [sum(histogram[j] for j in range(i + 1, len(histogram))) for i in range(positions)]
    return SpecCounts(
        sum(histogram),
        int(getattr(metrics, "num_draft_tokens", 0)),
        sum(j * count for j, count in enumerate(histogram)),
        per_position,
    )
