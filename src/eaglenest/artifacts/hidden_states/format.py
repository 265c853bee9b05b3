"""One hidden-state file: the format shared with vLLM's hidden-state connector and ``speculators train``, its
names, its metadata and its checks.

``hs_{i}.safetensors`` (a row file) holds prepared row ``i``:

* ``hidden_states`` ``[seq, n_aux + 1, hidden]`` — the residual stream after each aux layer (sorted) and,
  in the last slot, after the last decoder layer *before* the final norm; bf16 or fp32 (fp8: with
  ``hidden_states_scales`` ``[seq, 1, 1]``, speculators' FP8 layout).
* ``token_ids`` ``[seq]`` int64 — equal to the prepared ``input_ids``.

eaglenest adds one metadata entry to the safetensors header, ``eaglenest``: a JSON object with
``config`` (a hash of the verifier fingerprint, layer ids and dtype), ``layer_ids``, ``dtype``, ``backend``
and ``checksum``; other readers ignore it. (One key, because safetensors writes several in no fixed order,
and the files must be bit-identical between runs.) A file is trusted only if its header parses, its tensors
have the expected keys, dtypes and shapes, its length on disk matches what the header promises (so a truncated
file is caught without reading it), and its metadata matches the current configuration.

``checksum`` is the sha256 (hex) of the data section, taken row by row as the rows are written, in any order:
the sha256 of the row digests in row order (each the sha256 of the row's ``hidden_states`` bytes, then its
``hidden_states_scales`` bytes), then of the ``token_ids`` bytes and the ``row_index`` bytes. A file renamed into
place before its data reached the disk (a power loss) keeps its header and length but not its rows; only the
checksum tells it apart, so extract's resume and convert verify it before trusting a file.

``shard_{s}.safetensors`` (``extract.rows_per_shard`` R > 1) holds rows ``s*R .. s*R + R - 1`` (fewer in the
last shard) in the same format, concatenated along the sequence: ``hidden_states`` ``[tokens, n_aux + 1, hidden]``,
``token_ids`` ``[tokens]`` (and fp8's scales ``[tokens, 1, 1]``), plus the row index ``row_index`` ``[rows, 3]``
int64: each row's number, first token and length. Its metadata is a row file's with ``rows_per_shard`` and
``shard`` added. One file per shard instead of one per row is what DVC pays per file for on every status, push
and pull; a row is still read alone (a slice of the memory-mapped file).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from eaglenest.core.errors import InputFileError
from eaglenest.core.safetensors_header import Header, read_header

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
CHECKSUM_FIELD = "checksum"
NO_CHECKSUM = "its header holds no checksum (written by an older eaglenest)"
SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float32": "F32", "float16": "F16", FP8: "F8_E4M3"}
TORCH_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float16": torch.float16,
    FP8: torch.float8_e4m3fn,
}


class HiddenStateFileError(InputFileError):
    """A hidden-state file that cannot be read as the one expected.

    Attributes:
        path: The file.
        problem: What is wrong with it, without its name (callers that list problems by row name the file their
            own way).
    """

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = Path(path), problem


def hs_path(directory: Path, row: int) -> Path:
    """Where prepared row ``row``'s hidden states live (speculators' and vLLM's naming)."""
    return Path(directory) / f"hs_{row}.safetensors"


def _file_number(path: Path, prefix: str) -> int | None:
    """``N`` of a ``{prefix}{N}.safetensors`` file name, or None for any other name."""
    name, suffix = path.name, ".safetensors"
    digits = name[len(prefix) : -len(suffix)]
    return int(digits) if name.startswith(prefix) and name.endswith(suffix) and digits.isdigit() else None


def row_file_number(path: Path) -> int | None:
    """The number in an ``hs_{i}.safetensors`` file name (the row the file holds), or None for any other name."""
    return _file_number(path, "hs_")


def shard_path(directory: Path, shard: int) -> Path:
    """Where shard ``shard`` lives (``extract.rows_per_shard`` > 1)."""
    return Path(directory) / f"shard_{shard}.safetensors"


def shard_number(path: Path) -> int | None:
    """The shard of a ``shard_{s}.safetensors`` file name, or None for any other name."""
    return _file_number(path, "shard_")


def stored_files(directory: Path) -> list[Path]:
    """Every row file and shard file in ``directory`` (what DVC tracks of the hidden states), sorted by name."""
    return sorted(
        path
        for path in Path(directory).glob("*.safetensors")
        if row_file_number(path) is not None or shard_number(path) is not None
    )


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


def with_checksum(metadata: dict[str, str], checksum: str) -> dict[str, str]:
    """eaglenest's metadata (:func:`file_metadata`) with its ``checksum``; another tool's (no eaglenest entry)
    as it is."""
    if METADATA_KEY not in metadata:
        return metadata
    info = json.loads(metadata[METADATA_KEY]) | {CHECKSUM_FIELD: checksum}
    return {METADATA_KEY: json.dumps(info, sort_keys=True)}


def row_digest(stored: dict[str, torch.Tensor]) -> bytes:
    """The digest of one row's stored tensors (:func:`encode_hidden_states`, or a row read from a file): its
    hidden states' bytes, then its fp8 scales' bytes."""
    digest = hashlib.sha256()
    for key in (HIDDEN_KEY, SCALES_KEY):
        if key in stored:
            digest.update(stored[key].detach().to("cpu").contiguous().view(torch.uint8).numpy().data)
    return digest.digest()


def file_checksum(row_digests: list[bytes], fixed_parts: list[bytes]) -> str:
    """A file's checksum: its rows' digests in row order, then its token ids' and row index's bytes."""
    digest = hashlib.sha256(b"".join(row_digests))
    for part in fixed_parts:
        digest.update(part)
    return digest.hexdigest()


def checksum_problem(
    metadata: dict[str, str], row_digests: list[bytes], token_ids: torch.Tensor, index: torch.Tensor | None
) -> str | None:
    """What is wrong with a file's data against the checksum its header records, or None.

    Args:
        metadata: The header's metadata.
        row_digests: :func:`row_digest` of each of its rows as read, in row order.
        token_ids: Its ``token_ids`` as read.
        index: Its ``row_index`` as read (shards), or None (row files).
    """
    recorded_checksum = recorded(metadata, CHECKSUM_FIELD)
    if not isinstance(recorded_checksum, str):
        return NO_CHECKSUM
    fixed = [token_ids.numpy().tobytes()] + ([] if index is None else [index.numpy().tobytes()])
    if file_checksum(row_digests, fixed) != recorded_checksum:
        return "its data does not match its checksum (written over, or lost to a crash before it reached the disk)"
    return None


def verify_checksum(path: Path) -> str | None:
    """What is wrong with a finished file's data against its checksum, or None; reads it a row at a time."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            token_ids = handle.get_tensor(TOKENS_KEY)
            index = handle.get_tensor(ROW_INDEX_KEY) if ROW_INDEX_KEY in handle.keys() else None  # noqa: SIM118
            extents = (
                [(0, token_ids.numel())] if index is None else [(first, length) for _, first, length in index.tolist()]
            )
            digests = [row_digest(read_shard_row(handle, first, length)) for first, length in extents]
            return checksum_problem(handle.metadata() or {}, digests, token_ids, index)
    except (OSError, ValueError, RuntimeError, SafetensorError, KeyError) as err:
        return f"unreadable: {err}"


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


def check_header(
    path: Path, *, seq_len: int, num_slots: int, hidden_size: int, dtype: str | None, config: str | None = None
) -> str | None:
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
        header = _read_checked_header(path)
    except HiddenStateFileError as err:
        return err.problem
    problem = _tensor_problem(header, seq_len, num_slots, hidden_size, dtype, (HIDDEN_KEY, TOKENS_KEY))
    if problem is not None:
        return problem
    if config is not None and recorded(header.metadata, "config") != config:
        return "computed with another verifier, layer set or dtype"
    return None


def _read_checked_header(path: Path) -> Header:
    """A file's header.

    Raises:
        HiddenStateFileError: the file is missing, not safetensors, or truncated.
    """
    try:
        header = read_header(path)
    except FileNotFoundError:
        raise HiddenStateFileError(path, "missing") from None
    except (OSError, ValueError) as err:
        raise HiddenStateFileError(path, f"not a safetensors file: {err}") from None
    if header.actual_size != header.expected_size:
        raise HiddenStateFileError(
            path, f"{header.actual_size} bytes on disk, header promises {header.expected_size} (truncated?)"
        )
    return header


def _tensor_problem(
    header: Header, tokens: int, num_slots: int, hidden_size: int, dtype: str | None, keys: tuple[str, ...]
) -> str | None:
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


def read_hidden_state_file(
    path: Path, input_ids: list[int], verifier: VerifierInfo, dtype: str | None
) -> dict[str, torch.Tensor]:
    """A row file's tensors, checked (header, tokens, finiteness) in one read; an fp8 file's hidden states come back
    dequantized (float32).

    Raises:
        HiddenStateFileError: the file is bad: its header, its token ids or a non-finite value.
    """
    problem = check_header(
        path, seq_len=len(input_ids), num_slots=len(verifier.layer_ids), hidden_size=verifier.hidden_size, dtype=dtype
    )
    if problem is not None:
        raise HiddenStateFileError(path, problem)
    try:
        data = load_file(path)
    except (OSError, SafetensorError) as err:
        raise HiddenStateFileError(path, f"unreadable: {err}") from None
    hidden = checked_hidden_states(path, data, input_ids)  # fp8 already dequantized
    return {TOKENS_KEY: data[TOKENS_KEY], HIDDEN_KEY: hidden}


def check_shard_header(
    path: Path,
    *,
    rows: range,
    lengths: list[int],
    num_slots: int,
    hidden_size: int,
    dtype: str | None,
    config: str | None,
    rows_per_shard: int,
) -> str | None:
    """What is wrong with a shard's header and row index, or None.

    Args:
        path: The shard file.
        rows: The rows it must hold.
        lengths: Tokens of every prepared row (indexed by row).
        num_slots: n_aux + 1.
        hidden_size: The verifier's hidden size.
        dtype: Expected storage dtype name; None accepts any.
        config: Expected ``config`` in the metadata; None skips that check.
        rows_per_shard: The shard size the file must have been written with.
    """
    try:
        header = _read_checked_header(path)
    except HiddenStateFileError as err:
        return err.problem
    written_size = recorded(header.metadata, "rows_per_shard")
    if written_size != rows_per_shard:
        return f"written with extract.rows_per_shard = {written_size}, expected {rows_per_shard}"
    problem = _tensor_problem(
        header,
        sum(lengths[row] for row in rows),
        num_slots,
        hidden_size,
        dtype,
        (HIDDEN_KEY, TOKENS_KEY, ROW_INDEX_KEY),
    )
    if problem is not None:
        return problem
    if header.tensors[ROW_INDEX_KEY] != ("I64", [len(rows), 3]):
        return f"{ROW_INDEX_KEY} is {header.tensors[ROW_INDEX_KEY]}, expected I64 [{len(rows)}, 3]"
    if config is not None and recorded(header.metadata, "config") != config:
        return "computed with another verifier, layer set or dtype"
    try:
        index = read_shard_tensor(path, ROW_INDEX_KEY)
    except HiddenStateFileError as err:
        return err.problem
    start = 0
    for (row, first, length), expected in zip(index.tolist(), rows, strict=True):
        if row != expected or first != start or length != lengths[expected]:
            return (
                f"its row index disagrees with its tensors at row {expected}: [{row}, {first}, {length}], "
                f"expected [{expected}, {start}, {lengths[expected]}]"
            )
        start += length
    return None


def read_shard_tensor(path: Path, key: str) -> torch.Tensor:
    """One tensor of a file (its row index or token ids: small).

    Raises:
        HiddenStateFileError: the file cannot be read, or holds no ``key`` ("unreadable: ...").
    """
    try:
        with safe_open(str(path), framework="pt") as fh:
            return fh.get_tensor(key)
    except (OSError, ValueError, RuntimeError, SafetensorError, KeyError) as err:
        raise HiddenStateFileError(path, f"unreadable: {err}") from None


def shard_row_index(path: Path) -> dict[int, tuple[int, int]]:
    """``{row: (first token, length)}`` of a shard (its small ``row_index`` tensor only)."""
    with safe_open(str(path), framework="pt") as fh:
        return {int(row): (int(first), int(length)) for row, first, length in fh.get_tensor(ROW_INDEX_KEY).tolist()}


def read_shard_row(handle: Any, first: int, length: int) -> dict[str, torch.Tensor]:
    """One row's tensors, as stored, from an open shard (``safe_open``): slices of the mapped file, so memory is
    the row's, not the shard's."""
    rows = slice(first, first + length)
    return {key: handle.get_slice(key)[rows] for key in handle.keys() if key != ROW_INDEX_KEY}  # noqa: SIM118


def checked_hidden_states(path: Path, data: dict[str, torch.Tensor], input_ids: list[int]) -> torch.Tensor:
    """A row's decoded hidden states, from its stored tensors read from ``path``.

    Raises:
        HiddenStateFileError: its token ids differ from the prepared row's, or it holds a non-finite value.
    """
    if data[TOKENS_KEY].tolist() != input_ids:
        first = next(i for i, (a, b) in enumerate(zip(data[TOKENS_KEY].tolist(), input_ids, strict=True)) if a != b)
        raise HiddenStateFileError(path, f"token_ids differ from the prepared input_ids (first at position {first})")
    hidden = decode_hidden_states(data)
    finite = torch.isfinite(hidden)
    if not bool(finite.all()):
        bad = (~finite).nonzero()[0].tolist()
        raise HiddenStateFileError(
            path, f"{int((~finite).sum())} non-finite values (first at token {bad[0]}, slot {bad[1]})"
        )
    return hidden
