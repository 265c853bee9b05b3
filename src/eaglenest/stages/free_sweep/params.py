"""``free_sweep:`` in params.yaml: the free_sweep stage's params, and what the stage reads of the file."""

from __future__ import annotations

from pydantic import Field, field_validator

from eaglenest.artifacts.eval_params import EvalTimedSets
from eaglenest.core.params import StageParams, StrictModel


class FreeSweepParams(StrictModel):
    """``free_sweep:`` — vLLM's n-gram drafting (prompt lookup) at the lookup window and K that serve it fastest:
    the free baseline evaluate judges the draft against, and what ``eaglenest serve --baseline ngram`` serves.
    Reads the headline sets, their sampling, the engine settings and the turns evaluate times from ``evaluate:``."""

    ks: list[int] = Field(
        default_factory=lambda: [3, 4, 5],
        min_length=1,
        description="The Ks timed, each with the lookup window that accepts the most at that K: one engine each, "
        "all taking turns with the plain one. One K with lookup_min = lookup_max fixes the setting: it is still "
        "timed, and recorded.",
    )
    lookup_min: int = Field(
        default=1,
        ge=1,
        description="The shortest lookup windows considered: every prompt_lookup_min from this to lookup_max.",
    )
    lookup_max: int = Field(
        default=5,
        ge=1,
        description="The longest: every window prompt_lookup_min <= prompt_lookup_max <= this is replayed on the "
        "plain engine's greedy outputs with vLLM's own proposer (exact at temperature 0, and costs no engine), "
        "and the window needing the fewest verify steps at each K is the one timed.",
    )
    timed_prompts: int = Field(
        default=4,
        ge=1,
        description="Turns of each headline set decoded one at a time per engine: the first turns of the "
        "conversations after evaluate.timed_prompts, which the headline speed-ups never use (a setting chosen on "
        "the turns it is then measured on would be flattered by the choice). Each turn costs about 1.5 to 3.5 s "
        "per engine on 2 cores for SmolLM2-135M.",
    )

    @field_validator("ks")
    @classmethod
    def _ks_at_least_one(cls, value: list[int]) -> list[int]:
        if min(value) < 1:
            raise ValueError("every K must be at least 1 (K is the tokens drafted per verify step)")
        if len(set(value)) != len(value):
            raise ValueError("lists a K twice; list each K once")
        return value

    @staticmethod
    def consistency_problems(values: dict[str, object]) -> list[str]:
        low, high = values.get("lookup_min"), values.get("lookup_max")
        if isinstance(low, int) and isinstance(high, int) and low > high:
            return [
                f"free_sweep.lookup_min = {low} > free_sweep.lookup_max = {high}: the shortest window cannot "
                "exceed the longest"
            ]
        return []


class FreeSweepStageParams(StageParams):
    """What the free_sweep stage reads of params.yaml: its own section and what it shares of evaluate's (the headline
    sets, their sampling, the engines, the seed, the bootstrap and the turns evaluate times), nothing else of it."""

    free_sweep: FreeSweepParams = Field(default_factory=FreeSweepParams, description="The free_sweep stage.")
    evaluate: EvalTimedSets = Field(
        default_factory=EvalTimedSets,
        description="The evaluate stage's sets, engines and timed turns: the sweep times the turns after them.",
    )
