"""The hidden-state file format shared with vLLM's hidden-state connector and ``speculators train``.

``hs_{i}.safetensors`` holds prepared row ``i``:

* ``hidden_states`` ``[seq, n_aux + 1, hidden]`` — the residual stream after each aux layer (sorted) and,
  in the last slot, after the last decoder layer *before* the final norm; bf16 or fp32.
* ``token_ids`` ``[seq]`` int64 — equal to the prepared ``input_ids``.

eaglenest adds one metadata entry to the safetensors header, ``eaglenest``: a JSON object with
``config`` (a hash of the verifier fingerprint, layer ids and dtype), ``layer_ids``, ``dtype`` and
``backend``; other readers ignore it. (One key, because safetensors writes several in no fixed order,
and the files must be bit-identical between runs.) A rerun trusts a file only if its header
parses, its tensors have the expected keys, dtypes and shapes, its length on disk matches what the header
promises (so a truncated file is caught without reading it), and its metadata matches the current
configuration.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from eaglenest.core.atomic import atomic_write_bytes
from eaglenest.core.errors import InputFileError
from eaglenest.core.safetensors_header import read_header

if TYPE_CHECKING:
    from eaglenest.artifacts.verifier import VerifierInfo

HIDDEN_KEY = "hidden_states"
TOKENS_KEY = "token_ids"
# fp8 files carry one float32 scale per token, named and shaped as speculators' hs_connectors FP8 connector
# writes them, so its FP8Transfer reads eaglenest's files and eaglenest reads its.
SCALES_KEY = "hidden_states_scales"
FP8 = "float8_e4m3fn"
METADATA_KEY = "eaglenest"
SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float32": "F32", "float16": "F16", FP8: "F8_E4M3"}
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16,
                FP8: torch.float8_e4m3fn}
def hs_path(directory: Path, row: int) -> Path:
    """Where prepared row ``row``'s hidden states live (speculators' and vLLM's naming)."""
    return Path(directory) / f"hs_{row}.safetensors"


def row_index(path: Path) -> int | None:
    """The row of an ``hs_{i}.safetensors`` file name, or None for any other name."""
    name = path.name
    if name.startswith("hs_") and name.endswith(".safetensors") and name[3:-12].isdigit():
        return int(name[3:-12])
    return None


def extraction_fingerprint(verifier_fingerprint: str, layer_ids: list[int], dtype: str) -> str:
    """Identifies what a hidden-state file was computed from; a change invalidates every file."""
    key = json.dumps({"verifier": verifier_fingerprint, "layers": layer_ids, "dtype": dtype}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def file_metadata(config: str, layer_ids: list[int], dtype: str, backend: str) -> dict[str, str]:
    """The safetensors metadata eaglenest writes into every hidden-state file."""
    info = {"config": config, "layer_ids": layer_ids, "dtype": dtype, "backend": backend}
    return {METADATA_KEY: json.dumps(info, sort_keys=True)}


def encode_hidden_states(hidden_states: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """``[seq, slots, hidden]`` hidden states as stored in ``dtype``: the tensor itself, or for fp8 the
    quantized tensor and its per-token scales ``[seq, 1, 1]`` (speculators' own quantizer, so the bytes
    are those its FP8 connector writes)."""
    if dtype == FP8:
        from hs_connectors.fp8_utils import quantize_tensor_to_fp8

        quantized, scales = quantize_tensor_to_fp8(hidden_states)
        return {HIDDEN_KEY: quantized, SCALES_KEY: scales.float()}
    return {HIDDEN_KEY: hidden_states.to(TORCH_DTYPES[dtype])}


def decode_hidden_states(data: dict[str, torch.Tensor]) -> torch.Tensor:
    """The hidden states of a file's tensors: fp8 dequantized with its scales (in float32), any other dtype
    as stored."""
    hidden = data[HIDDEN_KEY]
    if SCALES_KEY in data:
        return hidden.float() * data[SCALES_KEY].float()
    return hidden


def write_hidden_states(path: Path, hidden_states: dict[str, torch.Tensor], token_ids: torch.Tensor,
                        metadata: dict[str, str]) -> int:
    """Writes one row atomically; returns the file size in bytes.

    Args:
        path: The ``hs_{row}.safetensors`` file.
        hidden_states: The stored tensors, from :func:`encode_hidden_states`.
        token_ids: ``[seq]`` the prepared row's tokens.
        metadata: eaglenest's metadata entry (:func:`file_metadata`).

    No fsync: a rename is atomic against a killed process, and a file torn by a power loss fails the
    length check in :func:`check_header` on the next run, which then recomputes it.
    """
    tensors = {name: tensor.contiguous() for name, tensor in hidden_states.items()}
    data = save({**tensors, TOKENS_KEY: token_ids.to(torch.int64).contiguous()}, metadata=metadata)
    atomic_write_bytes(path, data, fsync=False)
    return len(data)


def check_header(path: Path, *, seq_len: int, num_slots: int, hidden_size: int, dtype: str | None,
                 config: str | None = None) -> str | None:
    """What is wrong with a hidden-state file's header, or None if it is what we expect.

    Args:
        path: The file.
        seq_len: Tokens in the prepared row.
        num_slots: n_aux + 1.
        hidden_size: The verifier's hidden size.
        dtype: Expected storage dtype name ("bfloat16", "float32", "float8_e4m3fn", ...); None accepts any
            of them (files made by other tools, converted on the way in).
        config: Expected ``config`` in the ``eaglenest`` metadata; None skips that check (foreign files).
    """
    try:
        header = read_header(path)
    except FileNotFoundError:
        return "missing"
    except (OSError, ValueError) as err:
        return f"not a safetensors file: {err}"
    if header.actual_size != header.expected_size:
        return f"{header.actual_size} bytes on disk, header promises {header.expected_size} (truncated?)"
    missing = {HIDDEN_KEY, TOKENS_KEY} - header.tensors.keys()
    if missing:
        return f"missing key(s) {sorted(missing)}; has {sorted(header.tensors)}"
    hs_dtype, hs_shape = header.tensors[HIDDEN_KEY]
    if dtype is None:
        if hs_dtype not in SAFETENSORS_DTYPES.values():
            return f"{HIDDEN_KEY} dtype {hs_dtype}, expected one of {sorted(SAFETENSORS_DTYPES.values())}"
    elif hs_dtype != SAFETENSORS_DTYPES[dtype]:
        return f"{HIDDEN_KEY} dtype {hs_dtype}, expected {SAFETENSORS_DTYPES[dtype]} ({dtype})"
    if hs_shape != [seq_len, num_slots, hidden_size]:
        return f"{HIDDEN_KEY} shape {hs_shape}, expected [{seq_len}, {num_slots}, {hidden_size}]"
    if hs_dtype == SAFETENSORS_DTYPES[FP8]:
        if SCALES_KEY not in header.tensors:
            return f"fp8 {HIDDEN_KEY} without {SCALES_KEY} (the per-token scales): cannot be dequantized"
        scales_dtype, scales_shape = header.tensors[SCALES_KEY]
        if scales_dtype != "F32" or scales_shape != [seq_len, 1, 1]:
            return f"{SCALES_KEY} is {scales_dtype} {scales_shape}, expected F32 [{seq_len}, 1, 1]"
    tok_dtype, tok_shape = header.tensors[TOKENS_KEY]
    if tok_dtype != "I64" or tok_shape != [seq_len]:
        return f"{TOKENS_KEY} is {tok_dtype} {tok_shape}, expected I64 [{seq_len}]"
    if config is not None:
        try:
            recorded = json.loads(header.metadata.get(METADATA_KEY, "{}")).get("config")
        except (json.JSONDecodeError, AttributeError):
            recorded = None
        if recorded != config:
            return "computed with another verifier, layer set or dtype"
    return None


def read_hidden_state_file(path: Path, input_ids: list[int], verifier: VerifierInfo, dtype: str | None
                           ) -> tuple[str | None, dict[str, torch.Tensor] | None]:
    """(problem, None) for a bad file — header, tokens, finiteness — or (None, its tensors), in one read; an fp8
    file's hidden states come back dequantized (float32)."""
    problem = check_header(path, seq_len=len(input_ids), num_slots=len(verifier.layer_ids),
                           hidden_size=verifier.hidden_size, dtype=dtype)
    if problem is not None:
        return problem, None
    try:
        data = load_file(path)
    except (OSError, SafetensorError) as err:
        return f"unreadable: {err}", None
    if data[TOKENS_KEY].tolist() != input_ids:
        first = next(i for i, (a, b) in enumerate(zip(data[TOKENS_KEY].tolist(), input_ids, strict=True)) if a != b)
        return f"token_ids differ from the prepared input_ids (first at position {first})", None
    hidden = decode_hidden_states(data)
    finite = torch.isfinite(hidden)
    if not bool(finite.all()):
        bad = (~finite).nonzero()[0].tolist()
        return f"{int((~finite).sum())} non-finite values (first at token {bad[0]}, slot {bad[1]})", None
    return None, {TOKENS_KEY: data[TOKENS_KEY], HIDDEN_KEY: hidden}  # fp8 already dequantized


# extract.store: online keeps no files; the extract stage writes this manifest instead, so that DVC still sees
# an output change exactly when the rows, the verifier, its layers or the dtype change, and the train stage
# can refuse to compute hidden states for data the manifest was not written for.
MANIFEST_FILE = "manifest.json"


def rows_digest(input_ids: list[list[int]]) -> str:
    """sha256 of every prepared row's token ids, in order."""
    digest = hashlib.sha256()
    for ids in input_ids:
        digest.update(json.dumps(ids).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def online_manifest(verifier: VerifierInfo, dtype: str, input_ids: list[list[int]]) -> dict[str, object]:
    """What ``data/hidden_states/manifest.json`` records for ``extract.store: online``."""
    return {
        "store": "online",
        "rows": len(input_ids),
        "tokens": sum(len(ids) for ids in input_ids),
        "rows_sha256": rows_digest(input_ids),
        "verifier": verifier.fingerprint,
        "layer_ids": list(verifier.layer_ids),
        "hidden_size": verifier.hidden_size,
        "dtype": dtype,
        "config": extraction_fingerprint(verifier.fingerprint, verifier.layer_ids, dtype),
    }


def read_online_manifest(hs_dir: Path, verifier: VerifierInfo, input_ids: list[list[int]]) -> dict[str, object]:
    """The manifest of an online extraction, checked against the prepared rows and the verifier.

    Raises:
        InputFileError: it is missing, unreadable, or written for other rows / another verifier or layer set
            (one line, with the fix).
    """
    path = Path(hs_dir) / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputFileError(
            f"{path}: missing, but extract.store is online; run `dvc repro extract` (it writes the manifest)"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputFileError(f"{path}: not readable JSON ({err}); run `dvc repro extract`") from None
    if not isinstance(manifest, dict) or manifest.get("store") != "online" or manifest.get("dtype") not in TORCH_DTYPES:
        raise InputFileError(f"{path}: not an eaglenest online manifest; run `dvc repro extract`")
    expected = online_manifest(verifier, str(manifest["dtype"]), input_ids)
    stale = [key for key in ("rows", "rows_sha256", "verifier", "layer_ids", "hidden_size", "config")
             if manifest.get(key) != expected[key]]
    if stale:
        raise InputFileError(
            f"{path}: its {', '.join(stale)} differ from the prepared rows and verifier now (an earlier "
            "extract wrote it); run `dvc repro extract`"
        )
    return manifest
