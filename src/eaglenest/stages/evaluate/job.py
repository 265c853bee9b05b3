"""The evaluate back ends' contract: what a back end is given (:class:`EvaluationJob`), what it returns
(one metrics mapping per prompt set) and the figures every back end reports the same way
(:func:`set_metrics`). Back ends import this module, never the stage that dispatches to them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.core.params import EvaluateParams
from eaglenest.stages.evaluate.acceptance import Acceptance, total
from eaglenest.stages.evaluate.lossless import lossless_counts
from eaglenest.stages.evaluate.ngram import ngram_acceptance


@dataclass(frozen=True)
class EvaluationJob:
    """Everything an evaluate back end needs.

    Attributes:
        params: The evaluate params.
        verifier_dir: The verifier stage's output folder.
        prompt_sets: ``{set name: [prompt token ids]}``, each prompt rendered with the generation prompt.
        draft_dir: The train stage's speculators checkpoint.
    """

    params: EvaluateParams
    verifier_dir: Path
    prompt_sets: dict[str, list[list[int]]]
    draft_dir: Path


# A back end returns {set name: metrics}; the metrics come from set_metrics plus its own extras.
Backend = Callable[[EvaluationJob], dict[str, dict[str, Any]]]


@dataclass(frozen=True)
class Timed:
    """Decoded outputs (token ids, one list per prompt) and the wall time they took."""

    outputs: list[list[int]]
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return sum(map(len, self.outputs)) / self.seconds


def speed_metrics(plain: Timed, spec: Timed, suffix: str = "") -> dict[str, float]:
    """``tokens_per_s_plain{suffix}``, ``tokens_per_s_spec{suffix}`` and ``speedup{suffix}``."""
    return {
        f"tokens_per_s_plain{suffix}": round(plain.tokens_per_s, 2),
        f"tokens_per_s_spec{suffix}": round(spec.tokens_per_s, 2),
        f"speedup{suffix}": round(spec.tokens_per_s / plain.tokens_per_s, 4),
    }


def set_metrics(job: EvaluationJob, prompts: list[list[int]], k: int, acceptance: Acceptance, plain: Timed,
                spec: Timed, *, backend: str, dtype: str, batched: tuple[Timed, Timed] | None = None,
                plain_tops: list[Any] | None = None, tie_margin: float | None = None) -> dict[str, Any]:
    """One prompt set's metrics, as every back end reports them.

    Args:
        job: The evaluation.
        prompts: The set's prompts.
        k: Drafts per step.
        acceptance: The draft's counts over the set's single-stream decoding.
        plain: Plain decoding of each prompt alone (the reference output and the baseline speed).
        spec: Speculative decoding of each prompt alone.
        backend: The back end's name.
        dtype: The dtype the verifier ran in.
        batched: (plain, speculative) with all prompts in one call, where the back end batches.
        plain_tops: Per prompt and output position, plain decoding's top candidates, where the back end records
            them (vLLM at temperature 0): the divergence gaps are measured with them.
        tie_margin: The near-tie rule's margin (below float32); None is the exact rule.

    Returns:
        tau and acceptance, speed, the lossless counts and the n-gram baseline replayed on the plain output.
    """
    ngram = total([ngram_acceptance(p, out, k) for p, out in zip(prompts, plain.outputs, strict=True)], k).summary()
    return {
        **acceptance.summary(),
        **speed_metrics(plain, spec),
        **(speed_metrics(*batched, suffix="_batched") if batched is not None else {}),
        **lossless_counts(plain.outputs, spec.outputs, plain_tops, tie_margin),
        "lossless_rule": "exact" if tie_margin is None else "near_tie",
        **({"bf16_tie_margin": tie_margin} if tie_margin is not None else {}),
        "tau_ngram": ngram["tau"],
        "per_position_acceptance_ngram": ngram["per_position_acceptance"],
        "num_speculative_tokens": k,
        "num_prompts": len(prompts),
        "max_new_tokens": job.params.max_new_tokens,
        "temperature": job.params.temperature,
        "dtype": dtype,
        "backend": backend,
    }
