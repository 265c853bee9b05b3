"""``extract.store: stream``: the extract back ends as producers of training batches, on ``cluster.executor``.

Each task is one batch of rows the trainer will ask for, in the order it will ask (its plan: packed batches in a
deterministic order); an engine of ``extract.backend`` (the same
:class:`~eaglenest.artifacts.hidden_states.engines.contract.Engine` the extract stage runs, built by the same
registry) computes its rows and returns each as the extract stage would store it (checked, rounded to
``extract.dtype``). The executor streams the results back in the plan's order, with at most
``extract.stream_buffer`` batches ahead of the trainer, so the draft is the same whichever engine computed what,
and a batch whose engine died is computed again elsewhere before the trainer sees it.

A row's states depend on the rows computed in the same forward and on the kernels: with the hf back end's forward
per row (``extract.batch_tokens: 0``) they equal stored shards' bit for bit on the same kind of engine
and threads; batched (``extract.batch_tokens`` > 0, a batch being a task's rows) they agree to rounding.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eaglenest.artifacts.hidden_states.engines import engine_needs, make_engine
from eaglenest.artifacts.hidden_states.engines.contract import Engine, EngineSettings, StoredRow, compute_stored_rows
from eaglenest.artifacts.hidden_states.extract_params import ExtractParams
from eaglenest.artifacts.hidden_states.format import TOKENS_KEY
from eaglenest.artifacts.verifier import VerifierInfo
from eaglenest.core.errors import EaglenestError
from eaglenest.core.executor import check_cluster, open_executor
from eaglenest.core.params import ClusterParams


@dataclass(frozen=True)
class StreamTask:
    """One training batch's rows to compute (picklable: it travels to engine processes and Ray actors).

    Attributes:
        place: Its place in the plan (0: the trainer's first batch of this run).
        rows: The prepared rows, in the batch's order.
        input_ids: Their token ids.
        row_shape: ``(slots, hidden)``: a row's hidden states are ``[seq, *row_shape]`` (aux layers + the last).
        dtype: ``extract.dtype``: what each row is rounded to, as stored shards would be.
    """

    place: int
    rows: tuple[int, ...]
    input_ids: tuple[tuple[int, ...], ...]
    row_shape: tuple[int, ...]
    dtype: str

    @property
    def label(self) -> str:
        shown = ", ".join(map(str, self.rows[:4])) + (", ..." if len(self.rows) > 4 else "")
        return f"stream batch {self.place} (rows {shown})"


def run_stream_task(engine: Engine, task: StreamTask) -> dict[int, StoredRow]:
    """Computes the task's rows with ``engine``; returns each as the extract stage would store it, with its tokens."""
    ids = dict(zip(task.rows, task.input_ids, strict=True))
    stored = compute_stored_rows(engine, task.rows, ids, task.row_shape, task.dtype, task.label)
    return {row: {**tensors, TOKENS_KEY: torch.tensor(ids[row], dtype=torch.int64)} for row, tensors in stored.items()}


@dataclass
class StreamMeter:
    """What the trainer's side of a stream measured (train's metrics and progress show it).

    Attributes:
        engines: Engines the executor started.
        executor: ``cluster.executor``.
        window: ``extract.stream_buffer``.
        batches: Batches handed to the trainer.
        rows: Rows in them.
        wait_seconds: Time the trainer waited for the stream (its engines were behind).
        ready: Batches finished and waiting when the last one was handed over (the buffer's fill).
        ready_sum: ``ready`` summed over every batch handed over.
        started: When the stream started (``time.perf_counter``).
    """

    engines: int
    executor: str
    window: int
    batches: int = 0
    rows: int = 0
    wait_seconds: float = 0.0
    ready: int = 0
    ready_sum: int = 0
    started: float = field(default_factory=time.perf_counter)

    def record(self, rows: int, waited: float, ready: int) -> None:
        self.batches += 1
        self.rows += rows
        self.wait_seconds += waited
        self.ready = ready
        self.ready_sum += ready

    def figures(self) -> dict[str, Any]:
        """The stream's figures: engine rows/s over its life, the share of it the trainer spent waiting."""
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        return {
            "executor": self.executor,
            "engines": self.engines,
            "stream_buffer": self.window,
            "batches": self.batches,
            "rows": self.rows,
            "engine_rows_per_s": round(self.rows / elapsed, 2),
            "wait_seconds": round(self.wait_seconds, 3),
            "wait_share": round(self.wait_seconds / elapsed, 4),
            # batches finished ahead of the trainer, on average: near stream_buffer - 1, the engines keep up
            "mean_buffer_fill": round(self.ready_sum / self.batches, 2) if self.batches else None,
        }


class HiddenStateStream:
    """The batches of a plan, computed by a pool of engines; :meth:`next_batch` hands the next one to the trainer.

    Args:
        manifest: The extraction's manifest (its ``extract`` params build the engines).
        verifier: The verifier stage's record.
        model_dir: The verifier's weights.
        input_ids: Token ids of every prepared row.
        cluster: Where the engines run.
    """

    def __init__(
        self,
        manifest: dict[str, Any],
        verifier: VerifierInfo,
        model_dir: Path,
        input_ids: list[list[int]],
        cluster: ClusterParams,
    ) -> None:
        try:
            self.params = ExtractParams.model_validate(manifest["extract"])
        except ValueError as err:
            raise EaglenestError(
                f"the stream manifest's extract params are not valid ({err}); `dvc repro extract`"
            ) from None
        self.verifier, self.input_ids, self.cluster = verifier, input_ids, cluster
        self.settings = EngineSettings(verifier, Path(model_dir).resolve(), self.params, max(map(len, input_ids)))
        self._held = contextlib.ExitStack()
        self._executor: Any = None
        self._results: Iterator[tuple[StreamTask, dict[int, StoredRow]]] | None = None
        self.meter: StreamMeter | None = None

    def start(self, plan: Iterable[list[int]]) -> None:
        """Starts the engines on ``plan`` (the trainer's batches in the order it will ask for them)."""
        check_cluster(self.cluster)
        executor = self._executor = self._held.enter_context(open_executor(self.cluster, engine_needs(self.params)))
        self.meter = StreamMeter(executor.workers, self.cluster.executor, self.params.stream_buffer)
        tasks = (
            StreamTask(
                place,
                tuple(rows),
                tuple(tuple(self.input_ids[row]) for row in rows),
                (len(self.verifier.layer_ids), self.verifier.hidden_size),
                self.params.dtype,
            )
            for place, rows in enumerate(plan)
        )
        engine = functools.partial(make_engine, self.settings)
        self._results = executor.stream(engine, run_stream_task, tasks, self.params.stream_buffer)

    def next_batch(self, rows: list[int]) -> dict[int, StoredRow]:
        """The next batch of the plan, which must be ``rows``: training asks for exactly what was planned."""
        if self._results is None or self.meter is None:
            raise EaglenestError("the hidden-state stream was asked for a batch before it started")
        asked = time.perf_counter()
        task, computed = next(self._results, (None, {}))
        if task is None or list(task.rows) != list(rows):
            raise EaglenestError(
                f"the hidden-state stream's plan and training disagree: training asked for rows {rows[:5]}, "
                f"the plan's next batch is {list(task.rows[:5]) if task else 'none'}"
            )
        self.meter.record(len(rows), time.perf_counter() - asked, self._executor.finished_ahead)
        return computed

    def close(self) -> None:
        """Stops the engines (an unfinished plan's tasks are dropped)."""
        if self._results is not None:
            close = getattr(self._results, "close", None)  # a generator: the executor's own cleanup runs
            if close is not None:
                close()
            self._results = None
        self._held.close()
