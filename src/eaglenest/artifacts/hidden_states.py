"""The hidden-state file format shared with vLLM's hidden-state connector and ``speculators train``, and its
shards.

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

``shard_{s}.safetensors`` (``extract.rows_per_shard`` R > 1) holds rows ``s*R .. s*R + R - 1`` (fewer in the
last shard) in the same format, concatenated along the sequence: ``hidden_states`` ``[tokens, n_aux + 1, hidden]``,
``token_ids`` ``[tokens]`` (and fp8's ``hidden_states_scales`` ``[tokens, 1, 1]``), plus the row index
``row_index`` ``[rows, 3]`` int64: each row's number, first token and length. Its metadata is a row file's with
``rows_per_shard`` and ``shard`` added. One file per shard instead of one per row is what DVC pays per file
for on every status, push and pull; a row is still read alone (a slice of the memory-mapped file).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save

from eaglenest.core.atomic import atomic_open, atomic_write_bytes
from eaglenest.core.errors import InputFileError
from eaglenest.core.safetensors_header import Header, read_header, tensor_extents

if TYPE_CHECKING:
    from eaglenest.artifacts.verifier import VerifierInfo

HIDDEN_KEY = "hidden_states"
TOKENS_KEY = "token_ids"
# fp8 files carry one float32 scale per token, named and shaped as speculators' hs_connectors FP8 connector
# writes them, so its FP8Transfer reads eaglenest's files and eaglenest reads its.
SCALES_KEY = "hidden_states_scales"
FP8 = "float8_e4m3fn"
METADATA_KEY = "eaglenest"
ROW_INDEX_KEY = "row_index"
COPY_CHUNK_BYTES = 16 * 1024 * 1024
SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float32": "F32", "float16": "F16", FP8: "F8_E4M3"}
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16,
                FP8: torch.float8_e4m3fn}
def hs_path(directory: Path, row: int) -> Path:
    """Where prepared row ``row``'s hidden states live (speculators' and vLLM's naming)."""
    return Path(directory) / f"hs_{row}.safetensors"


def _file_number(path: Path, prefix: str) -> int | None:
    """``N`` of a ``{prefix}{N}.safetensors`` file name, or None for any other name."""
    name, suffix = path.name, ".safetensors"
    digits = name[len(prefix): -len(suffix)]
    return int(digits) if name.startswith(prefix) and name.endswith(suffix) and digits.isdigit() else None


def row_index(path: Path) -> int | None:
    """The row of an ``hs_{i}.safetensors`` file name, or None for any other name."""
    return _file_number(path, "hs_")


def shard_path(directory: Path, shard: int) -> Path:
    """Where shard ``shard`` lives (``extract.rows_per_shard`` > 1)."""
    return Path(directory) / f"shard_{shard}.safetensors"


def shard_number(path: Path) -> int | None:
    """The shard of a ``shard_{s}.safetensors`` file name, or None for any other name."""
    return _file_number(path, "shard_")


def shard_rows(shard: int, rows_per_shard: int, num_rows: int) -> range:
    """The rows shard ``shard`` holds: ``rows_per_shard`` consecutive ones, fewer in the last."""
    return range(shard * rows_per_shard, min((shard + 1) * rows_per_shard, num_rows))


def shards_of(rows: range, rows_per_shard: int) -> range:
    """The shards that hold ``rows`` (a part's rows start on a shard boundary)."""
    if not rows:
        return range(0)
    return range(rows.start // rows_per_shard, (rows.stop - 1) // rows_per_shard + 1)


def stored_files(directory: Path) -> list[Path]:
    """Every row file and shard file in ``directory`` (what DVC tracks of the hidden states), sorted by name."""
    return sorted(path for path in Path(directory).glob("*.safetensors")
                  if row_index(path) is not None or shard_number(path) is not None)


def layout_problem(directory: Path, rows_per_shard: int) -> str | None:
    """One line when the files in ``directory`` were written at another ``extract.rows_per_shard`` than
    ``rows_per_shard`` (row files where shards are expected, or shards of another size), else None. The extract
    stage re-shards such files without recomputing a row, so the fix is to run it."""
    fix = "run `dvc repro extract`: it re-shards the rows without recomputing them"
    files = stored_files(directory)
    shards = [path for path in files if shard_number(path) is not None]
    if rows_per_shard > 1 and files and not shards:
        return (f"{directory}: {len(files)} row files (hs_{{i}}.safetensors), written with extract.rows_per_shard = 1, "
                f"now {rows_per_shard}; {fix}")
    for path in shards:
        size = recorded_in(path, "rows_per_shard")
        if size is not None and size != rows_per_shard:  # None: unreadable or foreign, the row checks name it
            return f"{path}: written with extract.rows_per_shard = {size}, now {rows_per_shard}; {fix}"
    return None


def recorded_in(path: Path, key: str) -> object:
    """``key`` of eaglenest's metadata in the safetensors file ``path``; None when its header cannot be read."""
    try:
        return recorded(read_header(path).metadata, key)
    except (OSError, ValueError):
        return None


def extraction_fingerprint(verifier_fingerprint: str, layer_ids: list[int], dtype: str) -> str:
    """Identifies what a hidden-state file was computed from; a change invalidates every file."""
    key = json.dumps({"verifier": verifier_fingerprint, "layers": layer_ids, "dtype": dtype}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def file_metadata(config: str, layer_ids: list[int], dtype: str, backend: str) -> dict[str, str]:
    """The safetensors metadata eaglenest writes into every hidden-state file."""
    info = {"config": config, "layer_ids": layer_ids, "dtype": dtype, "backend": backend}
    return {METADATA_KEY: json.dumps(info, sort_keys=True)}


def shard_metadata(metadata: dict[str, str], rows_per_shard: int, shard: int) -> dict[str, str]:
    """A row file's metadata (:func:`file_metadata`) with the shard's size and number added."""
    info = json.loads(metadata.get(METADATA_KEY, "{}")) | {"rows_per_shard": rows_per_shard, "shard": shard}
    return {METADATA_KEY: json.dumps(info, sort_keys=True)}


def recorded(metadata: dict[str, str], key: str) -> object:
    """``key`` of eaglenest's metadata entry in a safetensors header's metadata, or None."""
    try:
        return json.loads(metadata.get(METADATA_KEY, "{}")).get(key)
    except (json.JSONDecodeError, AttributeError):
        return None


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
    header = _read_checked_header(path)
    if isinstance(header, str):
        return header
    problem = _tensor_problem(header, seq_len, num_slots, hidden_size, dtype, (HIDDEN_KEY, TOKENS_KEY))
    if problem is not None:
        return problem
    if config is not None and recorded(header.metadata, "config") != config:
        return "computed with another verifier, layer set or dtype"
    return None


def _read_checked_header(path: Path) -> Header | str:
    """A file's header, or what is wrong with it: missing, not safetensors, truncated."""
    try:
        header = read_header(path)
    except FileNotFoundError:
        return "missing"
    except (OSError, ValueError) as err:
        return f"not a safetensors file: {err}"
    if header.actual_size != header.expected_size:
        return f"{header.actual_size} bytes on disk, header promises {header.expected_size} (truncated?)"
    return header


def _tensor_problem(header: Header, tokens: int, num_slots: int, hidden_size: int, dtype: str | None,
                    keys: tuple[str, ...]) -> str | None:
    """What is wrong with the tensors a header lists for ``tokens`` tokens (a row's or a shard's), or None."""
    missing = set(keys) - header.tensors.keys()
    if missing:
        return f"missing key(s) {sorted(missing)}; has {sorted(header.tensors)}"
    hs_dtype, hs_shape = header.tensors[HIDDEN_KEY]
    if dtype is None:
        if hs_dtype not in SAFETENSORS_DTYPES.values():
            return f"{HIDDEN_KEY} dtype {hs_dtype}, expected one of {sorted(SAFETENSORS_DTYPES.values())}"
    elif hs_dtype != SAFETENSORS_DTYPES[dtype]:
        return f"{HIDDEN_KEY} dtype {hs_dtype}, expected {SAFETENSORS_DTYPES[dtype]} ({dtype})"
    if hs_shape != [tokens, num_slots, hidden_size]:
        return f"{HIDDEN_KEY} shape {hs_shape}, expected [{tokens}, {num_slots}, {hidden_size}]"
    if hs_dtype == SAFETENSORS_DTYPES[FP8]:
        if SCALES_KEY not in header.tensors:
            return f"fp8 {HIDDEN_KEY} without {SCALES_KEY} (the per-token scales): cannot be dequantized"
        scales_dtype, scales_shape = header.tensors[SCALES_KEY]
        if scales_dtype != "F32" or scales_shape != [tokens, 1, 1]:
            return f"{SCALES_KEY} is {scales_dtype} {scales_shape}, expected F32 [{tokens}, 1, 1]"
    tok_dtype, tok_shape = header.tensors[TOKENS_KEY]
    if tok_dtype != "I64" or tok_shape != [tokens]:
        return f"{TOKENS_KEY} is {tok_dtype} {tok_shape}, expected I64 [{tokens}]"
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
    problem, hidden = check_row_tensors(data, input_ids)
    if problem is not None:
        return problem, None
    return None, {TOKENS_KEY: data[TOKENS_KEY], HIDDEN_KEY: hidden}  # fp8 already dequantized


def pack_shard(directory: Path, shard: int, rows: range, rows_per_shard: int, metadata: dict[str, str]) -> int:
    """Packs the row files of ``rows`` (each already validated) into ``shard_{shard}.safetensors`` atomically, then
    deletes them; returns the shard's size in bytes.

    Each tensor of the shard is the rows' tensors concatenated along the sequence, which for row-major tensors is
    their bytes one after another: the shard is streamed from the row files' byte ranges, so memory stays at a
    copy buffer whatever the shard's size (a shard of a large verifier's long rows runs to tens of GB). The bytes
    are as stored (fp8 stays fp8 with its scales), and the same rows always make the same file.
    """
    paths = [hs_path(directory, row) for row in rows]
    extents = [tensor_extents(path) for path in paths]  # (data start, {name: (dtype, shape, begin, end)})
    names = sorted(extents[0][1])
    lengths = [extent[TOKENS_KEY][1][0] for _, extent in extents]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    row_index_bytes = torch.tensor([[row, start, length] for row, start, length in zip(
        rows, starts, lengths, strict=True)], dtype=torch.int64).numpy().tobytes()  # [rows, 3]
    header: dict[str, Any] = {"__metadata__": shard_metadata(metadata, rows_per_shard, shard)}
    offset = 0
    for name in names:
        dtype, shape, _, _ = extents[0][1][name]
        size = sum(end - begin for _, extent in extents for _, _, begin, end in [extent[name]])
        header[name] = {"dtype": dtype, "shape": [sum(lengths), *shape[1:]], "data_offsets": [offset, offset + size]}
        offset += size
    header[ROW_INDEX_KEY] = {"dtype": "I64", "shape": [len(lengths), 3],
                             "data_offsets": [offset, offset + len(row_index_bytes)]}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # safetensors aligns the data section to 8 bytes
    final = shard_path(directory, shard)
    with atomic_open(final, fsync=False) as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for name in names:
            for path, (data_start, extent) in zip(paths, extents, strict=True):
                _, _, begin, end = extent[name]
                with open(path, "rb") as source:
                    source.seek(data_start + begin)
                    remaining = end - begin
                    while remaining:
                        chunk = source.read(min(remaining, COPY_CHUNK_BYTES))
                        if not chunk:
                            raise OSError(f"{path}: shorter than its header says")
                        out.write(chunk)
                        remaining -= len(chunk)
        out.write(row_index_bytes)
    for path in paths:  # only once the shard holds them: a kill in between leaves both, and both validate
        path.unlink(missing_ok=True)
    return final.stat().st_size


def check_shard_header(path: Path, *, rows: range, lengths: list[int], num_slots: int, hidden_size: int,
                       dtype: str | None, config: str | None, rows_per_shard: int) -> str | None:
    """What is wrong with a shard's header and row index, or None.

    Args:
        path: The shard file.
        rows: The rows it must hold.
        lengths: Tokens of every prepared row (indexed by row).
        num_slots: n_aux + 1.
        hidden_size: The verifier's hidden size.
        dtype: Expected storage dtype name; None accepts any.
        config: Expected ``config`` in the metadata; None skips that check.
        rows_per_shard: ``extract.rows_per_shard`` now.
    """
    header = _read_checked_header(path)
    if isinstance(header, str):
        return header
    written_size = recorded(header.metadata, "rows_per_shard")
    if written_size != rows_per_shard:
        return (f"written with extract.rows_per_shard = {written_size}, now {rows_per_shard} (its valid rows are "
                "re-sharded by `dvc repro extract`)")
    problem = _tensor_problem(header, sum(lengths[row] for row in rows), num_slots, hidden_size, dtype,
                              (HIDDEN_KEY, TOKENS_KEY, ROW_INDEX_KEY))
    if problem is not None:
        return problem
    if header.tensors[ROW_INDEX_KEY] != ("I64", [len(rows), 3]):
        return f"{ROW_INDEX_KEY} is {header.tensors[ROW_INDEX_KEY]}, expected I64 [{len(rows)}, 3]"
    if config is not None and recorded(header.metadata, "config") != config:
        return "computed with another verifier, layer set or dtype"
    index = read_shard_tensor(path, ROW_INDEX_KEY)
    if isinstance(index, str):
        return index
    start = 0
    for (row, first, length), expected in zip(index.tolist(), rows, strict=True):
        if row != expected or first != start or length != lengths[expected]:
            return (f"its row index disagrees with its tensors at row {expected}: [{row}, {first}, {length}], "
                    f"expected [{expected}, {start}, {lengths[expected]}]")
        start += length
    return None


def read_shard_tensor(path: Path, key: str) -> torch.Tensor | str:
    """One tensor of a shard (its row index or token ids: small), or "unreadable: ..." when it cannot be read."""
    try:
        with safe_open(str(path), framework="pt") as fh:
            return fh.get_tensor(key)
    except (OSError, ValueError, RuntimeError, SafetensorError, KeyError) as err:
        return f"unreadable: {err}"


def shard_row_index(path: Path) -> dict[int, tuple[int, int]]:
    """``{row: (first token, length)}`` of a shard (its small ``row_index`` tensor only)."""
    with safe_open(str(path), framework="pt") as fh:
        return {int(row): (int(first), int(length)) for row, first, length in fh.get_tensor(ROW_INDEX_KEY).tolist()}


def read_shard_row(handle: Any, first: int, length: int) -> dict[str, torch.Tensor]:
    """One row's tensors, as stored, from an open shard (``safe_open``): slices of the mapped file, so memory is
    the row's, not the shard's."""
    rows = slice(first, first + length)
    return {key: handle.get_slice(key)[rows] for key in handle.keys() if key != ROW_INDEX_KEY}  # noqa: SIM118


def check_row_tensors(data: dict[str, torch.Tensor], input_ids: list[int]) -> tuple[str | None, torch.Tensor | None]:
    """(problem, None) when a row's stored tensors disagree with its prepared tokens or hold a non-finite value,
    else (None, its decoded hidden states)."""
    if data[TOKENS_KEY].tolist() != input_ids:
        first = next(i for i, (a, b) in enumerate(zip(data[TOKENS_KEY].tolist(), input_ids, strict=True)) if a != b)
        return f"token_ids differ from the prepared input_ids (first at position {first})", None
    hidden = decode_hidden_states(data)
    finite = torch.isfinite(hidden)
    if not bool(finite.all()):
        bad = (~finite).nonzero()[0].tolist()
        return f"{int((~finite).sum())} non-finite values (first at token {bad[0]}, slot {bad[1]})", None
    return None, hidden


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
