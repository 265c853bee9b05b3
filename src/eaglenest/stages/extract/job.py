"""The extract back ends' contract: what an engine is built from (:class:`EngineSettings`), what it does
(:class:`Engine`), and the task every executor runs (:func:`run_extract_task`). Back ends import this module,
never the stage that dispatches to them.

A task is one shard (or, with ``extract.rows_per_shard: 1``, a group of consecutive row files): the engine
computes its rows, in any order, and each row goes straight to its place in its file (:mod:`eaglenest.artifacts.
hidden_states.layout`). The same function runs in the stage's process (``cluster.executor: local``) and in a Ray
actor, so both write the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from eaglenest.artifacts.hidden_states.format import encode_hidden_states
from eaglenest.artifacts.hidden_states.layout import FileLayout, FileSink, FileWriter, MemorySink
from eaglenest.artifacts.verifier import VerifierInfo
from eaglenest.core.errors import EaglenestError
from eaglenest.stages.extract.params import ExtractParams

# (row, its [seq, n_aux + 1, hidden] hidden states) -> stored in the row's file
RowWriter = Callable[[int, torch.Tensor], None]


@dataclass(frozen=True)
class EngineSettings:
    """What an engine is built from, wherever it runs (picklable: it travels to Ray's workers).

    Attributes:
        verifier: The verifier stage's record.
        model_dir: The verifier's weights, an absolute path (the same on every node).
        params: The extract params.
        longest_row: Tokens of the longest prepared row (vLLM's context length).
        staging: vLLM's staging folder; None: a temporary folder on the engine's machine.
    """

    verifier: VerifierInfo
    model_dir: Path
    params: ExtractParams
    longest_row: int
    staging: Path | None = None


class Engine(Protocol):
    """A loaded back end (``name``: hf, vllm, import): computes rows and hands each to ``write``."""

    name: str

    def compute(self, rows: list[int], input_ids: dict[int, list[int]], write: RowWriter) -> None: ...


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


def checked_row(row: int, hidden: torch.Tensor, layout: FileLayout, backend: str) -> torch.Tensor:
    """``hidden`` ``[seq, n_aux + 1, hidden]`` on the CPU, refused when its shape is not the row's or a value is
    not finite (the verifier overflowed on this row: a file of it would fail convert, or poison training)."""
    place = layout.places["hidden_states"]
    expected = (len(layout.input_ids[row - layout.spec.rows.start]), *place.shape[1:])
    if tuple(hidden.shape) != expected:
        raise EaglenestError(
            f"the {backend} back end returned hidden states of shape {tuple(hidden.shape)} for row "
            f"{row}, expected {expected}"
        )
    hidden = hidden.to(device="cpu")
    finite = torch.isfinite(hidden)
    if not bool(finite.all()):
        token, slot, _ = (~finite).nonzero()[0].tolist()
        raise EaglenestError(
            f"row {row}: the verifier computed {int((~finite).sum())} non-finite hidden-state values (first at token "
            f"{token}, slot {slot}); check the row's tokens in the prepared data and the verifier's weights"
        )
    return hidden


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
        writer = owner[row]
        writer.write_row(row, encode_hidden_states(checked_row(row, hidden, writer.layout, backend), task.dtype))

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
