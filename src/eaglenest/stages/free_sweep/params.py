"""``free_sweep:`` in params.yaml: the free_sweep stage's params, and what the stage reads of the file."""

from __future__ import annotations

from pydantic import Field, ValidationInfo, field_validator

from eaglenest.artifacts.eval_params import EvalTimedSets
from eaglenest.core.params import StageParams, StrictModel


class FreeSweepParams(StrictModel):
    """``free_sweep:`` — the free drafters a user would serve instead of a draft, each at the setting that serves it
    fastest: vLLM's n-gram drafting (prompt lookup: window and K) and suffix decoding (tree depth, spec factor,
    least token probability and K), and the fastest of them named. Evaluate judges the draft against them, and
    ``eaglenest serve --baseline ngram|suffix`` serves them. Reads the headline sets, their sampling, the engine
    settings and the turns evaluate times from ``evaluate:``."""

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
    suffix_ks: list[int] = Field(
        default_factory=lambda: [4, 8],
        description="The Ks suffix decoding is timed at (its most tokens per step; it proposes fewer where its match "
        "is short), each with the setting of the grid below that accepts the most at that K: one engine each. [] "
        "sweeps n-gram drafting alone.",
    )
    suffix_depths: list[int] = Field(
        default_factory=lambda: [12, 24],
        min_length=1,
        description="suffix_decoding_max_tree_depth values replayed: the longest suffix of the text so far matched.",
    )
    suffix_spec_factors: list[float] = Field(
        default_factory=lambda: [1.0, 2.0],
        min_length=1,
        description="suffix_decoding_max_spec_factor values replayed: tokens proposed per matched token at most.",
    )
    suffix_min_token_probs: list[float] = Field(
        default_factory=lambda: [0.1, 0.3],
        min_length=1,
        description="suffix_decoding_min_token_prob values replayed: the least estimated probability of a proposed "
        "token. Every setting of the grid is replayed on the plain engine's greedy outputs with Arctic Inference's "
        "own suffix cache, in the order its engine is given them (exact at temperature 0, no engine).",
    )
    timed_prompts: int = Field(
        default=4,
        ge=1,
        description="Turns of each headline set decoded one at a time per engine: the first turns of the "
        "conversations after evaluate.timed_prompts, which the headline speed-ups never use (a setting chosen on "
        "the turns it is then measured on would be flattered by the choice). Each turn costs about 1.5 to 3.5 s "
        "per engine on 2 cores for SmolLM2-135M.",
    )

    @field_validator("ks", "suffix_ks")
    @classmethod
    def _ks_at_least_one(cls, value: list[int]) -> list[int]:
        if value and min(value) < 1:
            raise ValueError("every K must be at least 1 (K is the tokens drafted per verify step)")
        if len(set(value)) != len(value):
            raise ValueError("lists a K twice; list each K once")
        return value

    @field_validator("suffix_depths", "suffix_spec_factors", "suffix_min_token_probs")
    @classmethod
    def _suffix_grid(cls, value: list[float], info: ValidationInfo) -> list[float]:
        allowed = {
            "suffix_depths": (lambda v: v >= 1, "at least 1"),
            "suffix_spec_factors": (lambda v: v > 0, "above 0"),
            "suffix_min_token_probs": (lambda v: 0 <= v <= 1, "from 0 to 1"),
        }
        check, words = allowed[str(info.field_name)]
        if not all(check(v) for v in value):
            raise ValueError(f"every value must be {words}")
        if len(set(value)) != len(value):
            raise ValueError("lists a value twice; list each once")
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
