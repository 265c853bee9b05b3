"""Shards in the extract stage (``extract.rows_per_shard`` R > 1): what a rerun keeps, and packing as rows finish.

Back ends write one ``hs_{row}.safetensors`` per row, as with R = 1; rows finish in any order (vLLM's requests
do). Once every row of a shard has its file, :class:`ShardPacker` packs them into ``shard_{s}.safetensors`` and
deletes them. A kill at any moment leaves finished shards, row files of the unfinished ones, or both for a shard
being packed: each validates on its own, so a rerun keeps them all and computes only the rows that have neither.

A shard that no longer fits (``rows_per_shard`` changed, rows added or removed) is unpacked into row files for
its rows that still match the prepared data, then packed again at the new size: a changed shard size re-shards
without recomputing a valid row. A shard computed for another verifier, layer set or dtype is deleted.
"""

from __future__ import annotations

import logging
from pathlib import Path

from safetensors import SafetensorError, safe_open

from eaglenest.artifacts.hidden_states import (
    ROW_INDEX_KEY,
    TOKENS_KEY,
    check_shard_header,
    hs_path,
    pack_shard,
    read_shard_row,
    read_shard_tensor,
    recorded_in,
    shard_number,
    shard_path,
    shard_rows,
    shards_of,
    write_hidden_states,
)
from eaglenest.artifacts.verifier import VerifierInfo

log = logging.getLogger(__name__)


def shard_problem(path: Path, rows: range, input_ids: list[list[int]], verifier: VerifierInfo, dtype: str,
                  config: str, rows_per_shard: int) -> str | None:
    """Why ``path`` does not hold ``rows`` for this configuration (header and row index, then every row's token
    ids), or None when it does; "missing" when there is no file."""
    lengths = [len(ids) for ids in input_ids]
    problem = check_shard_header(path, rows=rows, lengths=lengths, num_slots=len(verifier.layer_ids),
                                 hidden_size=verifier.hidden_size, dtype=dtype, config=config,
                                 rows_per_shard=rows_per_shard)
    if problem is not None:
        return problem
    tokens = read_shard_tensor(path, TOKENS_KEY)
    if isinstance(tokens, str):
        return tokens
    tokens = tokens.tolist()
    start = 0
    for row in rows:
        if tokens[start: start + lengths[row]] != input_ids[row]:
            return f"row {row}: token_ids differ from the prepared row"
        start += lengths[row]
    return None


def unpack_shard(path: Path, input_ids: list[list[int]], metadata: dict[str, str]) -> int:
    """Writes the rows of a shard that still match their prepared rows as row files, then deletes the shard;
    returns how many rows were kept. The rows' tensors are copied as stored: nothing is recomputed."""
    kept = 0
    try:
        with safe_open(str(path), framework="pt") as fh:
            index = fh.get_tensor(ROW_INDEX_KEY).tolist()
            for row, first, length in index:
                if not 0 <= row < len(input_ids) or length != len(input_ids[row]):
                    continue
                data = read_shard_row(fh, first, length)
                if data[TOKENS_KEY].tolist() != input_ids[row]:
                    continue
                tokens = data.pop(TOKENS_KEY)
                write_hidden_states(hs_path(path.parent, row), data, tokens, metadata)
                kept += 1
    except (OSError, ValueError, RuntimeError, SafetensorError, KeyError) as err:
        log.info("%s: unreadable (%s); its rows are recomputed", path.name, err)
    path.unlink(missing_ok=True)
    return kept


def _shard_rows_on_disk(path: Path) -> range | None:
    """The rows a shard file's own index says it holds (contiguous), or None when unreadable."""
    index = read_shard_tensor(path, ROW_INDEX_KEY)
    if isinstance(index, str) or index.dim() != 2 or not len(index):
        return None
    rows = index[:, 0].tolist()
    return range(rows[0], rows[-1] + 1)


def plan_shards(out_dir: Path, rows: range, input_ids: list[list[int]], verifier: VerifierInfo, dtype: str,
                config: str, rows_per_shard: int, metadata: dict[str, str]) -> set[int]:
    """The rows of ``rows`` already held by a valid shard. Shards of this node that do not fit any more are
    unpacked into row files (their valid rows kept) or, computed for another configuration, deleted.

    Args:
        out_dir: ``data/hidden_states``.
        rows: This node's rows.
        input_ids: Token ids of every prepared row.
        verifier: The verifier stage's record.
        dtype: ``extract.dtype``.
        config: The extraction fingerprint.
        rows_per_shard: ``extract.rows_per_shard`` now (1: every shard is unpacked).
        metadata: The row files' metadata (for unpacked rows).
    """
    in_shards: set[int] = set()
    for path in sorted(out_dir.glob("shard_*.safetensors")):
        shard = shard_number(path)
        if shard is None:
            continue
        held = _shard_rows_on_disk(path)
        expected = shard_rows(shard, rows_per_shard, len(input_ids)) if rows_per_shard > 1 else range(0)
        # Several nodes share the folder: a node touches only shards within its own rows. An unreadable shard
        # says nothing of its rows: the node whose shard it would be now removes it, and a single node (all the
        # rows) removes any, so that no stale shard is left for the train stage to read.
        within = held if held is not None else expected
        single_node = rows == range(len(input_ids))
        if not single_node and (not within or within.start < rows.start or within.stop > rows.stop):
            continue
        if held is None:
            log.info("removing %s: unreadable; its rows are recomputed", path.name)
            path.unlink(missing_ok=True)
            continue
        problem = "extract.rows_per_shard is 1" if rows_per_shard == 1 else shard_problem(
            path, expected, input_ids, verifier, dtype, config, rows_per_shard)
        if problem is None:
            in_shards.update(expected)
        elif recorded_in(path, "config") == config:
            kept = unpack_shard(path, input_ids, metadata)
            log.info("re-sharding %s (%s): %d rows kept as row files", path.name, problem, kept)
        else:
            log.info("removing %s: %s", path.name, problem)
            path.unlink(missing_ok=True)
    return in_shards


class ShardPacker:
    """Packs each of a node's shards as soon as every one of its rows has a row file.

    Args:
        out_dir: ``data/hidden_states``.
        rows: This node's rows (whole shards).
        num_rows: Prepared rows in all.
        rows_per_shard: ``extract.rows_per_shard`` (> 1).
        in_shards: Rows already held by valid shards (:func:`plan_shards`).
        todo: Rows still to compute; the others have valid row files.
        metadata: The row files' metadata; the shard's adds its size and number.
    """

    def __init__(self, out_dir: Path, rows: range, num_rows: int, rows_per_shard: int, in_shards: set[int],
                 todo: list[int], metadata: dict[str, str]) -> None:
        self.out_dir, self.num_rows, self.rows_per_shard, self.metadata = out_dir, num_rows, rows_per_shard, metadata
        pending = set(todo)
        self.waiting: dict[int, set[int]] = {}
        for shard in shards_of(rows, rows_per_shard):
            shard_range = shard_rows(shard, rows_per_shard, num_rows)
            if shard_range and shard_range[0] not in in_shards:
                self.waiting[shard] = {row for row in shard_range if row in pending}
        self.packed = 0

    def pack_ready(self) -> None:
        """Packs every shard whose rows all have row files (from an earlier, interrupted run)."""
        for shard in [s for s, rows in self.waiting.items() if not rows]:
            self._pack(shard)

    def row_done(self, row: int) -> None:
        """A row's file is written; packs its shard if it was the shard's last."""
        shard = row // self.rows_per_shard
        rows = self.waiting.get(shard)
        if rows is None:
            return
        rows.discard(row)
        if not rows:
            self._pack(shard)

    def _pack(self, shard: int) -> None:
        pack_shard(self.out_dir, shard, shard_rows(shard, self.rows_per_shard, self.num_rows), self.rows_per_shard,
                   self.metadata)
        del self.waiting[shard]
        self.packed += 1


def missing_rows(out_dir: Path, rows: range, num_rows: int, rows_per_shard: int) -> list[int]:
    """Rows of ``rows`` without their final file: a row file (R = 1) or their shard's file (R > 1)."""
    if rows_per_shard == 1:
        return [row for row in rows if not hs_path(out_dir, row).is_file()]
    return [row for shard in shards_of(rows, rows_per_shard) if not shard_path(out_dir, shard).is_file()
            for row in shard_rows(shard, rows_per_shard, num_rows)]


def stored_size(out_dir: Path, rows: range, num_rows: int, rows_per_shard: int) -> int:
    """Bytes on disk of the files holding ``rows``."""
    if rows_per_shard == 1:
        return sum(hs_path(out_dir, row).stat().st_size for row in rows)
    return sum(shard_path(out_dir, shard).stat().st_size for shard in shards_of(rows, rows_per_shard))
