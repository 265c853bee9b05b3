"""``eaglenest init VERIFIER``: a ``params.yaml`` for a new verifier, each choice made for it explained.

Pointing the pipeline at a new verifier means choosing, from the model's own files, what the defaults cannot
know: its aux layers, whether its code must run (``auto_map``), whether its chat template reasons (``<think>``),
the draft's layer and vocabulary, and how many GPUs each vLLM engine spreads it over. ``init`` reads
``config.json``, the chat template and the weights' sizes (nothing is loaded, no code runs), takes the GPUs
from torch (or ``--gpus`` / ``--gpu-memory-gib``), and writes every params section: the values chosen for this
verifier carry a comment that says why, every other value is the default (docs/params.md). The file passes the
strict params check before it is written, and an existing file is kept unless ``--force``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from eaglenest.artifacts.hidden_states.extract_params import GPU_BATCH_TOKENS
from eaglenest.commands.params_file import parse_params
from eaglenest.core.atomic import atomic_write_bytes
from eaglenest.core.chat import REASONING_MARKERS
from eaglenest.core.errors import EaglenestError
from eaglenest.core.params import BUILTIN_PREFIX

# Draft vocabulary: speculators' recipes use 32k for verifiers with larger vocabularies; the CPU demo's 4096 trains
# faster on a CPU, where the draft's LM head is most of a step (docs/defaults.md).
GPU_DRAFT_VOCAB = 32_000
CPU_DRAFT_VOCAB = 4_096
# The weights may take this share of the GPU memory an engine is given: the rest is KV cache and activations.
WEIGHTS_SHARE = 0.75
# vLLM's engines in evaluate: three at once when timing is interleaved (a third of the memory each), else two.
INTERLEAVED_ENGINES = 3


@dataclass(frozen=True)
class VerifierFacts:
    """What ``init`` reads from a verifier's files."""

    model: str  # verifier.model as written: the folder as given, or builtin:NAME
    model_type: str
    num_layers: int
    num_attention_heads: int | None
    vocab_size: int
    weight_bytes: int
    remote_code: bool  # config.json has auto_map
    reasoning_template: bool  # the chat template handles <think> blocks
    remote_code_files: tuple[str, ...] = ()  # the Python files auto_map names, as config.json spells them


@dataclass(frozen=True)
class Gpus:
    """The GPUs the engines can use: how many, and the memory of one, in GiB."""

    count: int
    memory_gib: float


def chat_template_texts(folder: Path) -> list[str]:
    """Every chat template a model folder ships: tokenizer_config.json's, chat_template.jinja, chat_template.json."""
    texts: list[str] = []
    config = _json_file(folder / "tokenizer_config.json")
    template = (config or {}).get("chat_template")
    if isinstance(template, str):
        texts.append(template)
    elif isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        texts.extend(entry.get("template", "") for entry in template if isinstance(entry, dict))
    if (folder / "chat_template.jinja").is_file():
        texts.append((folder / "chat_template.jinja").read_text(encoding="utf-8"))
    separate = _json_file(folder / "chat_template.json")
    if separate and isinstance(separate.get("chat_template"), str):
        texts.append(separate["chat_template"])
    return texts


def _json_file(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise EaglenestError(f"{path}: not a readable JSON file: {err}") from None
    return value if isinstance(value, dict) else None


def read_folder(folder: Path, given: str) -> VerifierFacts:
    """A local model folder's facts, or one line saying why it is not a model folder."""
    if not folder.is_dir():
        raise EaglenestError(
            f"{given}: no such folder; give a model folder (config.json, weights, tokenizer) or "
            f"{BUILTIN_PREFIX}smollm2-135m-instruct"
        )
    config = _json_file(folder / "config.json")
    if config is None:
        raise EaglenestError(
            f"{given}: not a model folder (no config.json); give the folder holding the "
            "verifier's config.json, weights and tokenizer"
        )
    text = config.get("text_config") or config  # multimodal configs nest the language model's
    missing = [key for key in ("num_hidden_layers", "hidden_size", "vocab_size") if not isinstance(text.get(key), int)]
    if missing:
        raise EaglenestError(f"{folder / 'config.json'}: not a decoder model's config (no {', '.join(missing)})")
    templates = chat_template_texts(folder)
    if not templates:
        raise EaglenestError(
            f"{given}: has no chat template (tokenizer_config.json 'chat_template' or "
            "chat_template.jinja); eaglenest renders every conversation with the verifier's own"
        )
    weights = [p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth")]
    return VerifierFacts(
        model=given,
        model_type=str(text.get("model_type") or config.get("model_type") or "unknown"),
        num_layers=text["num_hidden_layers"],
        num_attention_heads=text.get("num_attention_heads"),
        vocab_size=text["vocab_size"],
        weight_bytes=sum(p.stat().st_size for p in weights),
        remote_code="auto_map" in config,
        remote_code_files=auto_map_files(config.get("auto_map")),
        reasoning_template=any(marker in t for t in templates for marker in REASONING_MARKERS),
    )


def auto_map_files(auto_map: Any) -> tuple[str, ...]:
    """The Python files config.json's ``auto_map`` loads: ``"module.Class"`` is ``module.py`` (a ``"repo--"``
    prefix names another repository's file); a value may be a list (a tokenizer's slow and fast class)."""
    if not isinstance(auto_map, dict):
        return ()
    references = [item for value in auto_map.values() for item in (value if isinstance(value, list) else [value])]
    return tuple(sorted({f"{ref.rpartition('.')[0]}.py" for ref in references if isinstance(ref, str) and "." in ref}))


def comment_safe(text: str) -> str:
    """A string from the model's files as it may stand in a YAML comment: quoted and escaped (JSON's rules, every
    non-ASCII character as ``\\uXXXX``), so a line break or escape in it cannot end the comment or reach a
    terminal."""
    return json.dumps(text, ensure_ascii=True).replace("\x7f", "\\u007f")


def read_builtin(name: str) -> VerifierFacts:
    """A built-in verifier's facts, read from the GGUF file its package ships (metadata only)."""
    from eaglenest.stages.verifier import BUILTIN_VERIFIERS, _builtin_gguf

    if name not in BUILTIN_VERIFIERS:
        raise EaglenestError(
            f"{BUILTIN_PREFIX}{name}: no such built-in verifier; allowed: "
            f"{', '.join(BUILTIN_PREFIX + n for n in BUILTIN_VERIFIERS.names())}"
        )
    gguf = _builtin_gguf(BUILTIN_VERIFIERS.get(name))
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    template = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).chat_template or ""
    hidden, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    # Materialised in float32: embeddings plus about 12 x hidden^2 per layer (attention and a 8/3-wide MLP).
    estimate = 4 * (vocab * hidden + layers * 12 * hidden * hidden)
    return VerifierFacts(
        model=f"{BUILTIN_PREFIX}{name}",
        model_type=config.model_type,
        num_layers=layers,
        num_attention_heads=config.num_attention_heads,
        vocab_size=vocab,
        weight_bytes=estimate,
        remote_code=False,
        reasoning_template=any(marker in template for marker in REASONING_MARKERS),
    )


def visible_gpus() -> Gpus:
    """The CUDA devices torch sees (none on a CPU machine)."""
    import torch

    if not torch.cuda.is_available():
        return Gpus(0, 0.0)
    return Gpus(torch.cuda.device_count(), torch.cuda.get_device_properties(0).total_memory / 2**30)


def init_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's [2, N//2, N-3] where those are distinct decoder layers; for shallow models, spread ids instead."""
    default = [2, num_layers // 2, num_layers - 3]
    if len(set(default)) == 3 and all(1 <= i <= num_layers - 1 for i in default):
        return default
    return sorted({max(1, min(i, num_layers - 1)) for i in (1, num_layers // 2, num_layers - 1)})


def tensor_parallel(facts: VerifierFacts, gpus: Gpus, engines: int, utilization: float) -> int | None:
    """The fewest GPUs (a power of two dividing the head count) over which each of ``engines`` engines fits;
    None when it does not fit on the GPUs there are."""
    size = 1
    while size <= gpus.count:
        divides = facts.num_attention_heads is None or facts.num_attention_heads % size == 0
        per_gpu = facts.weight_bytes / size / 2**30
        if divides and per_gpu <= WEIGHTS_SHARE * gpus.memory_gib * utilization / engines:
            return size
        size *= 2
    return None


def choose(facts: VerifierFacts, gpus: Gpus) -> tuple[dict[str, Any], dict[str, str]]:
    """The values chosen for this verifier, as ``{"section.key": value}``, and the comment that explains each."""
    values: dict[str, Any] = {}
    why: dict[str, str] = {}

    def pick(key: str, value: Any, reason: str) -> None:
        values[key], why[key] = value, reason

    pick(
        "verifier.model",
        facts.model,
        f"{comment_safe(facts.model_type)}, {facts.num_layers} layers, "
        f"vocabulary {facts.vocab_size:,}, {facts.weight_bytes / 2**30:.1f} GiB of weights",
    )
    if facts.remote_code:
        # Off even so: the pipeline would run a downloaded model's code on its first repro without anyone choosing
        # to; the comment (and init's warning) names the files a person reads before turning it on.
        pick("verifier.trust_remote_code", False, remote_code_reason(facts))
    aux = init_aux_layers(facts.num_layers)
    pick(
        "verifier.aux_layers",
        aux,
        "EAGLE-3's [2, N//2, N-3]"
        if aux == [2, facts.num_layers // 2, facts.num_layers - 3]
        else f"[2, N//2, N-3] collides for N = {facts.num_layers}: spread instead",
    )
    if facts.reasoning_template:
        pick(
            "prepare.reasoning",
            "keep",
            "the chat template handles <think> blocks: keep trains on the thinking "
            "a server emits with thinking on; strip if you serve with enable_thinking=False",
        )
    if facts.model_type.startswith("qwen3"):
        pick("train.draft_arch", "qwen3", "the verifier's own family's layer (per-head q/k norms)")
    vocab = GPU_DRAFT_VOCAB if gpus.count else CPU_DRAFT_VOCAB
    if facts.vocab_size <= vocab:
        pick("convert.draft_vocab_size", None, f"the verifier's {facts.vocab_size:,} tokens fit: the full vocabulary")
    else:
        pick(
            "convert.draft_vocab_size",
            vocab,
            "speculators' recipes' 32k draft vocabulary"
            if gpus.count
            else "no GPU seen: the CPU demo's 4096 (the draft's LM head is most of a CPU training step)",
        )

    if not gpus.count:
        return values, why
    seen = f"{gpus.count} GPU(s) of {gpus.memory_gib:.0f} GiB"
    pick(
        "extract.batch_tokens",
        GPU_BATCH_TOKENS,
        "hf back end: length-sorted batches keep a GPU busy (0, a forward per row, is the CPU's choice)",
    )
    for section in ("prepare.regenerate_vllm", "extract.vllm"):
        width = tensor_parallel(facts, gpus, 1, 0.85)
        pick(
            f"{section}.tensor_parallel_size",
            width or gpus.count,
            f"fits {width} of the {seen}"
            if width
            else f"does not fit on the {seen}: add GPUs, or nodes (extract.rank / world_size)",
        )
    interleaved = tensor_parallel(facts, gpus, INTERLEAVED_ENGINES, 0.85)
    if interleaved is not None:
        pick(
            "evaluate.vllm.tensor_parallel_size",
            interleaved,
            f"three engines take turns per prompt (evaluate.timing: interleaved); each fits {interleaved} of the "
            f"{seen}",
        )
    else:
        sequential = tensor_parallel(facts, gpus, 2, 0.85)
        pick("evaluate.timing", "sequential", f"three engines at once do not fit on the {seen}")
        pick(
            "evaluate.vllm.tensor_parallel_size",
            sequential or gpus.count,
            f"fits {sequential} of the {seen}"
            if sequential
            else f"does not fit on the {seen}: evaluate with more GPUs",
        )
    return values, why


def remote_code_reason(facts: VerifierFacts) -> str:
    """Why ``trust_remote_code`` stays off for a model that ships its own code, and what to read to turn it on."""
    files = ", ".join(comment_safe(name) for name in facts.remote_code_files) or "the .py files in its folder"
    return (
        f"the model ships its own Python code (config.json auto_map: {files}); read those files, then set "
        "verifier.trust_remote_code: true to let the pipeline run them"
    )


def _flow(value: Any) -> str:
    """One YAML value on one line (flow style)."""
    return (
        yaml.safe_dump(value, default_flow_style=True, width=2**16, sort_keys=False)
        .strip()
        .removesuffix("\n...")
        .removesuffix("...")
        .strip()
    )


def render(params: dict[str, Any], why: dict[str, str], header: list[str]) -> str:
    """params.yaml's text: one block per stage, nested sections as blocks, each chosen value with its reason."""
    lines = [f"# {line}" if line else "#" for line in header]

    def emit(prefix: str, mapping: dict[str, Any], indent: str) -> None:
        for key, value in mapping.items():
            path = f"{prefix}.{key}"
            comment = f"  # {why[path]}" if path in why else ""
            if isinstance(value, dict) and value:
                lines.append(f"{indent}{key}:{comment}")
                emit(path, value, indent + "  ")
            elif isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
                lines.append(f"{indent}{key}:{comment}")
                lines.extend(f"{indent}  - {_flow(item)}" for item in value)
            else:
                lines.append(f"{indent}{key}: {_flow(value)}{comment}")

    for section, mapping in params.items():
        lines.append("")
        lines.append(f"{section}:")
        emit(section, mapping, "  ")
    return "\n".join(lines) + "\n"


def init_params(
    verifier: str, out: Path, *, force: bool = False, gpus: Gpus | None = None
) -> tuple[list[str], list[str]]:
    """Writes ``out`` for ``verifier`` (a model folder or builtin:NAME); returns the lines to print and the warnings
    (for stderr)."""
    if out.exists() and not force:
        raise EaglenestError(f"{out} exists; pass --force to replace it, or --out another file")
    facts = (
        read_builtin(verifier.removeprefix(BUILTIN_PREFIX))
        if verifier.startswith(BUILTIN_PREFIX)
        else read_folder(Path(verifier).expanduser(), verifier)
    )
    gpus = visible_gpus() if gpus is None else gpus
    values, why = choose(facts, gpus)

    params = parse_params({}).model_dump(mode="json")
    for key, value in values.items():
        *parents, leaf = key.split(".")
        section = params
        for parent in parents:
            section = section[parent]
        section[leaf] = value
    parse_params(params, str(out))  # the strict check, before anything is written

    header = [
        f"params.yaml for {verifier}, written by `eaglenest init`. Values chosen for this verifier say",
        "why on their line; every other value is the default (docs/params.md). Unknown keys are errors.",
        "Override one value for an experiment: dvc exp run -S train.lr=3e-4",
    ]
    atomic_write_bytes(out, render(params, why, header).encode("utf-8"))
    gpu_line = f"{gpus.count} GPU(s) of {gpus.memory_gib:.0f} GiB" if gpus.count else "no GPU"
    warnings = [f"warning: {out}: verifier.trust_remote_code: false: {remote_code_reason(facts)}"] * facts.remote_code
    return [
        f"wrote {out} for {verifier} ({gpu_line}):",
        *(f"  {key}: {_flow(values[key])}  ({why[key]})" for key in values),
    ], warnings
