"""The extract stage's tasks, which every executor runs (:func:`run_row_task`, :func:`run_extract_task`) with the
hidden-state engines (:mod:`eaglenest.artifacts.hidden_states.engines`).

A task is a unit of about ``ROWS_PER_TASK`` rows, small enough that every engine stays busy to the end (a shard
each would leave engines idle while the last shards are computed):

* :class:`RowTask`: some rows of one shard (:func:`row_tasks` cuts a shard into them), returned as stored
  (:func:`~eaglenest.artifacts.hidden_states.format.encode_hidden_states`) to the stage's own process, which writes
  each into its place in the shard's file; the shard appears complete once its last row is in.
* :class:`ExtractTask`: whole files, written by the task itself: ``ROWS_PER_TASK`` consecutive row files
  (``extract.rows_per_shard: 1``), or a shard each where every worker writes into a folder all of them share.

Either way the engine computes the rows, in any order, and each row goes to its place in its file
(:mod:`eaglenest.artifacts.hidden_states.layout`). The same functions run in the stage's process
(``cluster.executor: local``) and in a Ray actor, on the same tasks, so both write the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eaglenest.artifacts.hidden_states.engines.contract import (
    Engine,
    StoredRow,
    checked_row,
    compute_stored_rows,
    length_sorted_batches,
)
from eaglenest.artifacts.hidden_states.extract_params import ExtractParams
from eaglenest.artifacts.hidden_states.format import encode_hidden_states
from eaglenest.artifacts.hidden_states.layout import (
    ROWS_PER_TASK,
    FileLayout,
    FileSink,
    FileWriter,
    MemorySink,
    ShardSpec,
)


@dataclass(frozen=True)
class ExtractTask:
    """One task: the files it writes, and where (a folder every worker sees, or None: back to the driver).

    Attributes:
        layouts: Its files' layouts (one shard, or consecutive row files).
        dtype: ``extract.dtype``, the rows' storage dtype.
        destination: The unfinished folder to write the files into; None returns their bytes.
    """

    layouts: tuple[FileLayout, ...]
    dtype: str
    destination: Path | None

    @property
    def label(self) -> str:
        """ "shard 3 (rows 12..15)", or "rows 64..127 (row files)"."""
        if len(self.layouts) == 1:
            return self.layouts[0].spec.label
        return f"rows {self.layouts[0].spec.rows.start}..{self.layouts[-1].spec.rows.stop - 1} (row files)"

    @property
    def rows(self) -> list[int]:
        return [row for layout in self.layouts for row in layout.spec.rows]


@dataclass(frozen=True)
class RowTask:
    """Some rows of one shard, computed by an engine and returned as stored to the stage's own process, which writes
    them into the shard's file (:meth:`~eaglenest.artifacts.hidden_states.resume.Extraction.accept_rows`).

    Attributes:
        spec: The shard.
        rows: Its rows this task computes (for hf: whole batches of the shard's length-sorted plan).
        input_ids: Token ids of each of ``rows``, in order.
        row_shape: ``(n_aux + 1, hidden)``: a row's hidden states are ``[seq, *row_shape]``.
        dtype: ``extract.dtype``, the rows' storage dtype.
        part: Which of the shard's tasks this is, from 0.
        parts: How many tasks the shard is cut into.
    """

    spec: ShardSpec
    rows: tuple[int, ...]
    input_ids: tuple[tuple[int, ...], ...]
    row_shape: tuple[int, ...]
    dtype: str
    part: int = 0
    parts: int = 1

    @property
    def label(self) -> str:
        """ "shard 3 (rows 768..1023)", or "shard 3 (rows 768..1023), task 2 of 4"."""
        return self.spec.label if self.parts == 1 else f"{self.spec.label}, task {self.part + 1} of {self.parts}"


def row_tasks(layout: FileLayout, params: ExtractParams) -> list[RowTask]:
    """A shard cut into tasks of about ``ROWS_PER_TASK`` rows (at least that many, but the last).

    hf: each task is consecutive whole batches of the shard's own length-sorted plan, which the engine packs again
    into the same batches, so each row is computed in the batch it would share in a whole-shard task (padding and
    batch shape change a row's bytes). vllm and import: consecutive rows (they do not batch by the plan).
    """
    rows = list(layout.spec.rows)
    lengths = {row: len(ids) for row, ids in zip(rows, layout.input_ids, strict=True)}
    units = length_sorted_batches(rows, lengths, params.batch_tokens) if params.backend == "hf" else [[r] for r in rows]
    chunks: list[list[int]] = [[]]
    for unit in units:
        if len(chunks[-1]) >= ROWS_PER_TASK:
            chunks.append([])
        chunks[-1] += unit
    start = layout.spec.rows.start
    row_shape = layout.places["hidden_states"].shape[1:]
    return [
        RowTask(
            layout.spec,
            tuple(sorted(chunk)),
            tuple(layout.input_ids[row - start] for row in sorted(chunk)),
            row_shape,
            params.dtype,
            part,
            len(chunks),
        )
        for part, chunk in enumerate(chunks)
    ]


def run_row_task(engine: Engine, task: RowTask) -> list[tuple[int, StoredRow]]:
    """Computes the task's rows with ``engine``; returns ``(row, its tensors as stored)`` for each, in row order.

    Raises:
        EaglenestError: a row came back with the wrong shape, a non-finite value, twice, or not at all.
    """
    ids = dict(zip(task.rows, task.input_ids, strict=True))
    stored = compute_stored_rows(engine, task.rows, ids, task.row_shape, task.dtype, task.label)
    return [(row, stored[row]) for row in task.rows]


def run_extract_task(engine: Engine, task: ExtractTask) -> list[tuple[str, Any]]:
    """Computes the task's rows with ``engine``; returns ``(file name, path or bytes)`` per file.

    With a destination, each file is written there (preallocated, renamed when complete), and a file already there
    (the task ran before, and its worker died after writing it) is kept as it is; without one, each file's bytes
    come back in a buffer.
    """
    writers, results, owner = [], [], {}
    for layout in task.layouts:
        if task.destination is not None and layout.written_at(layout.spec.path(task.destination)):
            results.append((layout.spec.name, layout.spec.path(task.destination)))
            continue
        sink = MemorySink(layout) if task.destination is None else FileSink(layout, layout.spec.path(task.destination))
        writers.append(FileWriter(layout, sink))
        owner.update(dict.fromkeys(layout.spec.rows, writers[-1]))
    backend = getattr(engine, "name", "extract")

    def write(row: int, hidden: torch.Tensor) -> None:
        layout = owner[row].layout
        expected = (len(layout.input_ids[row - layout.spec.rows.start]), *layout.places["hidden_states"].shape[1:])
        owner[row].write_row(row, encode_hidden_states(checked_row(row, hidden, expected, backend), task.dtype))

    done = False
    try:
        if owner:
            ids = {
                row: list(writer.layout.input_ids[row - writer.layout.spec.rows.start]) for row, writer in owner.items()
            }
            engine.compute(sorted(owner), ids, write)
        results += [(writer.layout.spec.name, writer.finish()) for writer in writers]
        done = True
    finally:
        if not done:
            for writer in writers:
                writer.abort()
    return results
