"""Where every row goes: the shard plan of a data set, and each file's bytes laid out before any row is computed.

The rows of a data set fall into shards of ``extract.rows_per_shard`` consecutive rows (:func:`shard_plan`); with
1 each row is its own ``hs_{i}.safetensors``. A row's token count is known from the prepared data, so a file's
safetensors header and the byte offset of each row's tensors are known before the row is computed
(:func:`file_layout`). :class:`FileWriter` writes the header, the token ids and the row index first, then each
row's tensors at their offsets as the row arrives, in any order (vLLM's requests finish in any order): memory
stays at one row, and no file is written twice (once as rows, again packed). Each row's digest is taken as it is
written, and the file's checksum (:func:`~eaglenest.artifacts.hidden_states.format.file_checksum`) goes into the
header's place kept for it once the last row is in, so nothing is read back. Its sink is a preallocated temporary
file, fsync'd and renamed into place once every row is in (:class:`FileSink`), or a buffer of the file's size
(:class:`MemorySink`) that a Ray worker returns to the driver: both receive the same writes at the same offsets,
so both give the same bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eaglenest.artifacts.hidden_states.format import (
    CHECKSUM_FIELD,
    FP8,
    HIDDEN_KEY,
    METADATA_KEY,
    ROW_INDEX_KEY,
    SAFETENSORS_DTYPES,
    SCALES_KEY,
    TOKENS_KEY,
    TORCH_DTYPES,
    extraction_fingerprint,
    file_checksum,
    file_metadata,
    hs_path,
    row_digest,
    row_file_number,
    shard_metadata,
    shard_path,
    with_checksum,
)
from eaglenest.core.atomic import atomic_open
from eaglenest.core.errors import EaglenestError

# Rows of one task of the extract stage: small enough that every engine stays busy to the end of a run, large
# enough that rows are still batched. A task of row files (rows_per_shard 1) holds this many consecutive files; a
# shard is cut into tasks of about this many rows (eaglenest.stages.extract.job.row_tasks).
ROWS_PER_TASK = 64
ITEM_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "I64": 8}
# Holds the checksum's place in a header written before any row is computed: as long as a sha256 in hex, and
# never one, so a header that somehow kept it fails its check.
CHECKSUM_PLACEHOLDER = "?" * 64


@dataclass(frozen=True)
class ShardSpec:
    """One file of the layout: a shard of ``rows`` (``rows_per_shard`` > 1), or one row's file (1).

    Attributes:
        number: The shard's number, or the row's for a row file.
        rows: The prepared rows it holds, consecutive.
        rows_per_shard: ``extract.rows_per_shard`` of the layout.
    """

    number: int
    rows: range
    rows_per_shard: int

    @property
    def row_files(self) -> bool:
        """Whether the layout holds one ``hs_{i}.safetensors`` per row rather than shards of several rows."""
        return self.rows_per_shard == 1

    @property
    def name(self) -> str:
        """The file's name: ``shard_{s}.safetensors`` or ``hs_{i}.safetensors``."""
        return self.path(Path()).name

    def path(self, directory: Path) -> Path:
        return hs_path(directory, self.number) if self.row_files else shard_path(directory, self.number)

    @property
    def label(self) -> str:
        """For messages: "shard 3 (rows 12..15)" or "row 7"."""
        if self.row_files:
            return f"row {self.number}"
        return f"shard {self.number} (rows {self.rows.start}..{self.rows.stop - 1})"


def shard_plan(num_rows: int, rows_per_shard: int) -> list[ShardSpec]:
    """Every file of a data set of ``num_rows`` rows: ``rows_per_shard`` consecutive rows each, fewer in the last."""
    return [
        ShardSpec(start // rows_per_shard, range(start, min(start + rows_per_shard, num_rows)), rows_per_shard)
        for start in range(0, num_rows, rows_per_shard)
    ]


def task_groups(specs: list[ShardSpec]) -> list[list[ShardSpec]]:
    """The files to compute, grouped into tasks that write whole files: a shard each, or ``ROWS_PER_TASK``
    consecutive row files.

    A group is cut by the plan (row ``r``'s file belongs to group ``r // ROWS_PER_TASK``), not by what is left
    to compute, so both executors cut the same tasks.
    """
    groups: dict[int, list[ShardSpec]] = {}
    for spec in specs:
        key = spec.number // ROWS_PER_TASK if spec.row_files else spec.number
        groups.setdefault(key, []).append(spec)
    return [groups[key] for key in sorted(groups)]


@dataclass(frozen=True)
class TensorPlace:
    """Where one tensor of a file lies: absolute byte offsets, its safetensors dtype and shape."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class FileLayout:
    """Every byte of one hidden-state file, known from its rows' token ids.

    Attributes:
        spec: The file.
        input_ids: Token ids of each of its rows, in order.
        stored_dtype: ``extract.dtype`` (fp8 adds the per-token scales).
        header: The 8-byte length and the JSON header, padded to 8 bytes.
        places: Each tensor's place, by name.
        first_tokens: Each row's first token within the file.
        checksum_at: Where the checksum goes in the header; None for another tool's file (no eaglenest metadata).
    """

    spec: ShardSpec
    input_ids: tuple[tuple[int, ...], ...]
    stored_dtype: str
    header: bytes
    places: dict[str, TensorPlace]
    first_tokens: tuple[int, ...]
    checksum_at: int | None

    @property
    def size(self) -> int:
        return max(place.end for place in self.places.values())

    def written_at(self, path: Path) -> bool:
        """Whether ``path`` already holds this file: it appears only complete (a rename), so its size and header
        say so (a task run again after its worker died once it had written the file); its data is checked against
        its checksum by whoever accepts it."""
        try:
            with open(path, "rb") as fh:
                size, header = os.fstat(fh.fileno()).st_size, fh.read(len(self.header))
        except OSError:
            return False
        if self.checksum_at is not None:  # the one part of the header that depends on the rows
            end = self.checksum_at + len(CHECKSUM_PLACEHOLDER)
            header = header[: self.checksum_at] + self.header[self.checksum_at : end] + header[end:]
        return size == self.size and header == self.header

    def fixed_parts(self) -> list[tuple[int, bytes]]:
        """(offset, bytes) of what is known before any row is computed: the header, the token ids, the row index."""
        tokens = torch.tensor([t for ids in self.input_ids for t in ids], dtype=torch.int64)  # [tokens]
        parts = [(0, self.header), (self.places[TOKENS_KEY].begin, tokens.numpy().tobytes())]
        if ROW_INDEX_KEY in self.places:
            index = torch.tensor(
                [
                    [row, first, len(ids)]
                    for row, first, ids in zip(self.spec.rows, self.first_tokens, self.input_ids, strict=True)
                ],
                dtype=torch.int64,
            )  # [rows, 3]
            parts.append((self.places[ROW_INDEX_KEY].begin, index.numpy().tobytes()))
        return parts

    def row_parts(self, row: int, stored: dict[str, torch.Tensor]) -> list[tuple[int, Any]]:
        """(offset, bytes) of row ``row``'s stored tensors (from :func:`encode_hidden_states`), checked against the
        layout: its keys, dtypes and shapes."""
        i = row - self.spec.rows.start
        length, first = len(self.input_ids[i]), self.first_tokens[i]
        expected = {HIDDEN_KEY, SCALES_KEY} & self.places.keys()
        if set(stored) != expected:
            raise EaglenestError(f"row {row}: tensors {sorted(stored)}, expected {sorted(expected)}")
        parts = []
        for name, tensor in stored.items():
            place = self.places[name]
            if SAFETENSORS_DTYPES.get(_dtype_name(tensor)) != place.dtype or tuple(tensor.shape) != (
                length,
                *place.shape[1:],
            ):
                raise EaglenestError(
                    f"row {row}: {name} is {tensor.dtype} {tuple(tensor.shape)}, expected "
                    f"{place.dtype} {(length, *place.shape[1:])}"
                )
            per_token = (place.end - place.begin) // place.shape[0]
            data = tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy()  # row-major: the rows' bytes
            parts.append((place.begin + first * per_token, data))
        return parts


def _dtype_name(tensor: torch.Tensor) -> str:
    return next((name for name, dtype in TORCH_DTYPES.items() if dtype == tensor.dtype), str(tensor.dtype))


def file_layout(
    spec: ShardSpec,
    input_ids: list[list[int]],
    num_slots: int,
    hidden_size: int,
    stored_dtype: str,
    metadata: dict[str, str],
) -> FileLayout:
    """The layout of ``spec``'s file.

    Args:
        spec: The file.
        input_ids: Token ids of each of its rows, in order.
        num_slots: n_aux + 1.
        hidden_size: The verifier's hidden size.
        stored_dtype: ``extract.dtype``, or the dtype the tensors are stored in (copied as they are).
        metadata: A row file's metadata (:func:`file_metadata`); a shard's adds its size and number.
    """
    lengths = [len(ids) for ids in input_ids]
    tokens = sum(lengths)
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {
        HIDDEN_KEY: (SAFETENSORS_DTYPES[stored_dtype], (tokens, num_slots, hidden_size)),
        TOKENS_KEY: ("I64", (tokens,)),
    }
    if stored_dtype == FP8:
        tensors[SCALES_KEY] = ("F32", (tokens, 1, 1))
    if not spec.row_files:
        tensors[ROW_INDEX_KEY] = ("I64", (len(lengths), 3))
        metadata = shard_metadata(metadata, spec.rows_per_shard, spec.number)
    metadata = with_checksum(metadata, CHECKSUM_PLACEHOLDER)
    # Data in name order; the JSON lists the metadata first (none for another tool's file), then the tensors.
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset, relative = 0, {}
    for name in sorted(tensors):
        dtype, shape = tensors[name]
        size = ITEM_BYTES[dtype] * int(np.prod(shape))
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        relative[name] = (offset, offset + size)
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # safetensors aligns the data section to 8 bytes
    start = 8 + len(encoded)
    places = {
        name: TensorPlace(tensors[name][0], tensors[name][1], start + begin, start + end)
        for name, (begin, end) in relative.items()
    }
    first_tokens = tuple(sum(lengths[:i]) for i in range(len(lengths)))
    found = encoded.find(CHECKSUM_PLACEHOLDER.encode())
    return FileLayout(
        spec,
        tuple(tuple(ids) for ids in input_ids),
        stored_dtype,
        struct.pack("<Q", len(encoded)) + encoded,
        places,
        first_tokens,
        None if found < 0 else 8 + found,
    )


@dataclass(frozen=True)
class HiddenStatePlan:
    """Every file of one extraction and what each must hold: the extract stage builds it, writes its files from it,
    and its resume checks finished files against it.

    Attributes:
        input_ids: Token ids of every prepared row.
        rows_per_shard: ``extract.rows_per_shard``.
        layer_ids: The verifier's hidden-state slots: its aux layers, then its last.
        hidden_size: The verifier's hidden size.
        verifier_fingerprint: The verifier's fingerprint.
        dtype: ``extract.dtype``.
        backend: ``extract.backend``, recorded in every file.
    """

    input_ids: list[list[int]]
    rows_per_shard: int
    layer_ids: list[int]
    hidden_size: int
    verifier_fingerprint: str
    dtype: str
    backend: str

    @property
    def num_slots(self) -> int:
        """n_aux + 1."""
        return len(self.layer_ids)

    @cached_property
    def config(self) -> str:
        """The extraction fingerprint every file records (:func:`extraction_fingerprint`)."""
        return extraction_fingerprint(self.verifier_fingerprint, self.layer_ids, self.dtype)

    @cached_property
    def files(self) -> list[ShardSpec]:
        """Every file of the layout, in order."""
        return shard_plan(len(self.input_ids), self.rows_per_shard)

    @property
    def metadata(self) -> dict[str, str]:
        """The metadata every file records."""
        return file_metadata(self.config, self.layer_ids, self.dtype, self.backend)

    def layout(self, spec: ShardSpec) -> FileLayout:
        """Every byte of ``spec``'s file but its rows' hidden states."""
        return file_layout(
            spec,
            [self.input_ids[row] for row in spec.rows],
            self.num_slots,
            self.hidden_size,
            self.dtype,
            self.metadata,
        )


class MemorySink:
    """The file's bytes in a buffer of its size (a Ray worker returns it; the driver writes it)."""

    def __init__(self, layout: FileLayout) -> None:
        self.buffer = np.zeros(layout.size, dtype=np.uint8)  # zeroed like a preallocated file

    def write(self, offset: int, data: Any) -> None:
        view = np.frombuffer(data, dtype=np.uint8)
        self.buffer[offset : offset + view.size] = view

    def finish(self) -> np.ndarray:
        return self.buffer

    def abort(self) -> None:
        self.buffer = np.zeros(0, dtype=np.uint8)


class FileSink:
    """A temporary file of the final size next to ``final``, written at offsets, then fsync'd and renamed into place
    when complete (:func:`~eaglenest.core.atomic.atomic_open`: a file renamed before its data reached the disk
    would come back from a power loss as a file of the right size and header holding zeros)."""

    def __init__(self, layout: FileLayout, final: Path) -> None:
        self.final = final
        self._open = contextlib.ExitStack()
        self.fd = self._open.enter_context(atomic_open(final)).fileno()  # written with pwrite, never buffered
        try:
            os.ftruncate(self.fd, layout.size)  # sparse until written: the disk is taken row by row
        except OSError as err:
            self.abort()
            raise _write_failed(final, err) from None

    def write(self, offset: int, data: Any) -> None:
        view = memoryview(data).cast("B")
        try:
            while view:
                written = os.pwrite(self.fd, view, offset)
                view, offset = view[written:], offset + written
        except OSError as err:
            self.abort()
            raise _write_failed(self.final, err) from None

    def finish(self) -> Path:
        self._open.close()  # fsync, rename (atomic_open: on a failure, nothing is left under either name)
        return self.final

    def abort(self) -> None:
        # atomic_open deletes its temporary when its block ends in an exception; the exception itself is ours
        self._open.__exit__(EaglenestError, EaglenestError(f"{self.final}: aborted"), None)


def _write_failed(final: Path, err: OSError) -> EaglenestError:
    return EaglenestError(f"could not write {final}: {err.strerror or err} (nothing was left under that name)")


class FileWriter:
    """Writes one file of the layout through ``sink``: the fixed parts now, each row as it arrives (its digest
    taken), then :meth:`finish` once every row is in (the checksum written into the header)."""

    def __init__(self, layout: FileLayout, sink: MemorySink | FileSink) -> None:
        self.layout, self.sink = layout, sink
        self.missing = set(layout.spec.rows)
        self.digests: dict[int, bytes] = {}
        parts = layout.fixed_parts()
        self.fixed_data = [data for _, data in parts[1:]]  # token ids, row index: the checksum's last parts
        for offset, data in parts:
            sink.write(offset, data)

    def write_row(self, row: int, stored: dict[str, torch.Tensor]) -> None:
        """Row ``row``'s stored tensors (:func:`encode_hidden_states`) at their offsets."""
        if row not in self.missing:
            raise EaglenestError(f"{self.layout.spec.label}: row {row} written twice, or not one of its rows")
        for offset, data in self.layout.row_parts(row, stored):
            self.sink.write(offset, data)
        self.digests[row] = row_digest(stored)
        self.missing.discard(row)

    def finish(self) -> Any:
        """The sink's result (the final path, or the buffer) once every row is written."""
        if self.missing:
            self.sink.abort()
            raise EaglenestError(f"{self.layout.spec.label}: rows {sorted(self.missing)} were never written")
        if self.layout.checksum_at is not None:
            checksum = file_checksum([self.digests[row] for row in self.layout.spec.rows], self.fixed_data)
            self.sink.write(self.layout.checksum_at, checksum.encode())
        return self.sink.finish()

    def abort(self) -> None:
        self.sink.abort()


def write_hidden_states(
    path: Path, hidden_states: dict[str, torch.Tensor], token_ids: torch.Tensor, metadata: dict[str, str]
) -> int:
    """Writes one row file atomically in the layout above; returns its size in bytes.

    Args:
        path: The ``hs_{row}.safetensors`` file.
        hidden_states: The stored tensors, from :func:`encode_hidden_states` (fp8: with its scales).
        token_ids: ``[seq]`` the prepared row's tokens.
        metadata: eaglenest's metadata entry (:func:`file_metadata`), or none for a file of another tool.
    """
    hidden = hidden_states[HIDDEN_KEY]
    row = row_file_number(Path(path)) or 0
    spec = ShardSpec(row, range(row, row + 1), 1)
    layout = file_layout(spec, [token_ids.tolist()], hidden.shape[1], hidden.shape[2], _dtype_name(hidden), metadata)
    writer = FileWriter(layout, FileSink(layout, Path(path)))
    writer.write_row(row, hidden_states)
    writer.finish()
    return layout.size


def metadata_of_row_files(metadata: dict[str, str]) -> dict[str, str]:
    """A shard's metadata as its rows' files carry it: its size and number dropped."""
    info = json.loads(metadata.get(METADATA_KEY, "{}"))
    info.pop("rows_per_shard", None)
    info.pop("shard", None)
    info.pop(CHECKSUM_FIELD, None)  # the shard's: each row file gets its own
    return {METADATA_KEY: json.dumps(info, sort_keys=True)}
