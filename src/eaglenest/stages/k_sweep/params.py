"""``k_sweep:`` in params.yaml: the k_sweep stage's params, and what the stage reads of the file."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, field_validator

from eaglenest.artifacts.eval_params import EvalSetsAndEngines
from eaglenest.core.params import StageParams, StrictModel


class KSweepParams(StrictModel):
    """``k_sweep:`` — K, the drafts per verify step, chosen by timing the trained draft at each K (what
    ``eaglenest serve`` uses for this draft). Reads the headline sets, their sampling and the engine settings from
    ``evaluate:``."""

    removed_keys: ClassVar[dict[str, str]] = {
        "ngram": "n-gram drafting is timed at each window and K by the free_sweep stage (params free_sweep.*)"
    }

    ks: list[int] | None = Field(
        default=None,
        min_length=1,
        description="The Ks timed, each at least 1; null: 1 to the draft's own K (train.ttt_steps). Each K is an "
        "engine, timed two at a time beside the plain one.",
    )
    timed_prompts: int = Field(
        default=4,
        ge=1,
        description="Turns of each headline set decoded one at a time per engine and round, fewer than "
        "evaluate.timed_prompts: the sweep chooses between Ks, evaluate measures the chosen one. Each turn costs "
        "about 1.5 to 3.5 s per engine on an idle 2-core EPYC for SmolLM2-135M (docs/experiments.md).",
    )
    repeats: int = Field(
        default=1,
        ge=1,
        description="Rounds of timing on the same engines; the spread between rounds shows the timing noise.",
    )

    @field_validator("ks")
    @classmethod
    def _ks_at_least_one(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and min(value) < 1:
            raise ValueError("every K must be at least 1 (K is the drafts per verify step)")
        if value is not None and len(set(value)) != len(value):
            raise ValueError("lists a K twice; list each K once")
        return value


class KSweepStageParams(StageParams):
    """What the k_sweep stage reads of params.yaml: its own section and what it shares of evaluate's (the headline
    sets, their sampling, the engines, the seed and the bootstrap), nothing else of it."""

    k_sweep: KSweepParams = Field(default_factory=KSweepParams, description="The k_sweep stage.")
    evaluate: EvalSetsAndEngines = Field(
        default_factory=EvalSetsAndEngines,
        description="The evaluate stage's sets and engines, which the sweep times (not its timed_prompts, timing, "
        "reference or K).",
    )
