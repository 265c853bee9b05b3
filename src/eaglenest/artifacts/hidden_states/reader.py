"""Reading ``data/hidden_states``: which layout it holds, where each row is, and a row's tensors as stored.

Readers (convert, train, ``eaglenest export`` and ``inspect``) never glob file names or read
``extract.rows_per_shard``: :func:`open_stored` reads the shard size from the shards' own headers (row files only:
1), refuses a folder mixing layouts, and :class:`StoredHiddenStates` answers where row ``i`` lives and reads it.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eaglenest.artifacts.hidden_states.format import (
    ROW_INDEX_KEY,
    read_shard_row,
    recorded_in,
    row_file_number,
    shard_number,
    stored_files,
)
from eaglenest.artifacts.hidden_states.layout import ShardSpec, shard_plan
from eaglenest.core.errors import InputFileError

FIX = "run `dvc repro extract` (it writes the folder anew)"


class StoredHiddenStates:
    """A hidden-state folder of one layout: ``rows_per_shard`` 1 (row files) or R (shards of R rows).

    Args:
        folder: ``data/hidden_states``.
        num_rows: Prepared rows in all.
        rows_per_shard: The layout's shard size (:func:`open_stored` reads it from the files).
    """

    # Open shards (a memory map and a parsed header each) are kept for the next rows: training draws rows at
    # random, so a row's shard is rarely the last one's. Each shard's row index is [rows, 3] int64: 24 bytes a row.
    open_limit = 16

    def __init__(self, folder: Path, num_rows: int, rows_per_shard: int) -> None:
        self.folder, self.num_rows, self.rows_per_shard = Path(folder), num_rows, rows_per_shard
        self._handles: OrderedDict[int, Any] = OrderedDict()
        self._indices: dict[int, dict[int, tuple[int, int]]] = {}

    @property
    def row_files(self) -> bool:
        """Whether the folder holds one ``hs_{i}.safetensors`` per row rather than shards of several rows."""
        return self.rows_per_shard == 1

    @property
    def plan(self) -> list[ShardSpec]:
        """Every file the layout holds, in order."""
        return shard_plan(self.num_rows, self.rows_per_shard)

    def spec_of(self, row: int) -> ShardSpec:
        """The file that holds ``row``."""
        start = row - row % self.rows_per_shard
        return ShardSpec(
            row // self.rows_per_shard,
            range(start, min(start + self.rows_per_shard, self.num_rows)),
            self.rows_per_shard,
        )

    def path_of(self, row: int) -> Path:
        return self.spec_of(row).path(self.folder)

    def location(self, row: int) -> str:
        """Where a row's hidden states are stored, for messages: its file, or its shard and row."""
        path = self.path_of(row)
        return str(path) if self.row_files else f"{path} row {row}"

    def size_of(self, rows: list[int]) -> int:
        """Bytes on disk of the files holding ``rows``."""
        return sum(
            spec.path(self.folder).stat().st_size
            for spec in {self.spec_of(row).number: self.spec_of(row) for row in rows}.values()
        )

    def read_row(self, row: int) -> dict[str, torch.Tensor]:
        """Row ``row``'s tensors as stored (fp8 with its scales): its file, or a slice of its memory-mapped shard,
        so memory is the row's, never a shard's.

        Raises:
            InputFileError: the shard's row index does not hold ``row`` where it belongs (changed since convert).
        """
        if self.row_files:
            return load_file(self.path_of(row))
        shard = row // self.rows_per_shard
        handle = self._handle(shard)
        if shard not in self._indices:
            index = handle.get_tensor(ROW_INDEX_KEY).tolist()  # [rows, 3]: row, first token, length
            self._indices[shard] = {int(r): (int(first), int(length)) for r, first, length in index}
        if row not in self._indices[shard]:
            raise InputFileError(
                f"{self.path_of(row)}: its row index does not hold row {row}; run `dvc repro extract convert`"
            )
        return read_shard_row(handle, *self._indices[shard][row])

    def _handle(self, shard: int) -> Any:
        if shard in self._handles:
            self._handles.move_to_end(shard)
        else:
            self._handles[shard] = safe_open(
                str(self.spec_of(shard * self.rows_per_shard).path(self.folder)), framework="pt"
            )
            if len(self._handles) > self.open_limit:
                evicted, _ = self._handles.popitem(last=False)
                self._indices.pop(evicted, None)
        return self._handles[shard]


def open_stored(folder: Path, num_rows: int) -> StoredHiddenStates:
    """The folder's layout, read from its files.

    Raises:
        InputFileError: the folder holds row files and shards, or shards of different sizes, or no shard whose
            header says its size (one line, with the fix).
    """
    files = stored_files(folder)
    shards = [path for path in files if shard_number(path) is not None]
    row_files = [path for path in files if row_file_number(path) is not None]
    if not shards:
        return StoredHiddenStates(folder, num_rows, 1)
    if row_files:
        raise InputFileError(
            f"{folder}: holds {len(row_files)} row files (hs_{{i}}.safetensors) and {len(shards)} "
            f"shards (shard_{{s}}.safetensors), two layouts in one folder; {FIX}"
        )
    sizes: dict[int, Path] = {}
    for path in shards:
        size = recorded_in(path, "rows_per_shard")
        if isinstance(size, int) and size > 1:
            sizes.setdefault(size, path)
    if len(sizes) > 1:
        (one, first), (other, second) = sorted(sizes.items())[:2]
        raise InputFileError(
            f"{folder}: shards of different sizes ({first.name}: {one} rows, {second.name}: {other} rows); {FIX}"
        )
    if not sizes:
        raise InputFileError(f"{folder}: no shard's header says its size ({shards[0].name} is unreadable); {FIX}")
    return StoredHiddenStates(folder, num_rows, next(iter(sizes)))
