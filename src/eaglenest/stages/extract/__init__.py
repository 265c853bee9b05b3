"""The extract stage: the verifier's hidden states for every prepared row, resumable, on one machine or a Ray
cluster.

Phases: :func:`plan_extraction` (the layout's files, which are already finished, what is left),
:func:`compute_hidden_states` (tasks of about ``ROWS_PER_TASK`` rows cut from the shards, run by
``cluster.executor``; the stage's own process writes each task's rows into its shard's file) and
:func:`finish_extraction` (the files moved into ``data/hidden_states``, the metrics).

``data/hidden_states`` is a plain DVC output: DVC clears it before the stage runs, and restores an earlier
extraction from its run-cache instead of running the stage when params and inputs match one. A run's finished
files wait in ``data/hidden_states.unfinished/`` (:mod:`eaglenest.artifacts.hidden_states.resume`), so a run that
was killed, or stopped by a failing task, loses none: the next one checks each (header, dtype, shapes, length,
the verifier / layers / dtype fingerprint, every row's token ids, the data against its checksum) and computes only
the rest. The executor changes where the work runs, never what it writes: both run the same task function on the
same tasks, cut from the layout alone. A shard's file appears complete or not at all: a run killed mid-shard
computes that shard's rows again.

One extraction writes a folder at a time: the stage's own process (the driver, with a Ray cluster: never its
workers, which write parts of one run's unfinished folder side by side) holds the lock of
``data/hidden_states.unfinished`` (:mod:`eaglenest.core.lock`) from before it looks at a file until the output is
complete, so a second extract of the same workspace (``python stages/extract.py`` beside a ``dvc repro``) is refused
in one line before it touches the first's files.
"""

from __future__ import annotations

import functools
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.artifacts.hidden_states.engines import engine_needs, make_engine
from eaglenest.artifacts.hidden_states.engines.contract import EngineSettings
from eaglenest.artifacts.hidden_states.engines.vllm import staging_dir_for
from eaglenest.artifacts.hidden_states.extract_params import ExtractParams
from eaglenest.artifacts.hidden_states.format import stored_files
from eaglenest.artifacts.hidden_states.layout import FileLayout, HiddenStatePlan, ShardSpec, task_groups
from eaglenest.artifacts.hidden_states.online import MANIFEST_FILE, online_manifest
from eaglenest.artifacts.hidden_states.resume import Extraction, unfinished_dir
from eaglenest.artifacts.prepared import load_input_ids
from eaglenest.artifacts.verifier import VerifierInfo, load_verifier_info
from eaglenest.core.atomic import atomic_write_json, remove_stale_temps
from eaglenest.core.errors import EaglenestError
from eaglenest.core.executor import Executor, check_cluster, in_this_process, open_executor
from eaglenest.core.host import host_record
from eaglenest.core.lock import exclusive, lock_file_for
from eaglenest.core.params import ClusterParams
from eaglenest.core.stage import PreparedInput, Stage, path_arg
from eaglenest.stages.extract.job import ExtractTask, RowTask, row_tasks, run_extract_task, run_row_task
from eaglenest.stages.extract.params import ExtractStageParams

log = logging.getLogger(__name__)


def _check_rows(input_ids: list[list[int]], verifier: VerifierInfo) -> None:
    """Refuses rows the verifier cannot take: longer than its context, or a token id outside its vocabulary."""
    limit = verifier.max_position_embeddings
    too_long = [(row, len(ids)) for row, ids in enumerate(input_ids) if limit is not None and len(ids) > limit]
    if too_long:
        row, length = too_long[0]
        raise EaglenestError(
            f"prepared row {row} has {length} tokens, more than the verifier's context of {limit} "
            f"({len(too_long)} rows in all); set prepare.max_len <= {limit}"
        )
    outside = [
        (row, max(ids))
        for row, ids in enumerate(input_ids)
        if ids and not 0 <= min(ids) <= max(ids) < verifier.vocab_size
    ]
    if outside:
        row, token = outside[0]
        raise EaglenestError(
            f"prepared row {row} holds token id {token}, outside the verifier's vocabulary of {verifier.vocab_size} "
            f"({len(outside)} rows in all); was data/prepared written with another tokenizer? `dvc repro prepare`"
        )


@dataclass(frozen=True)
class ExtractionPlan:
    """What this run of the extract stage must do (the first phase's result).

    Attributes:
        params: The extract params.
        verifier: The verifier stage's record.
        model_dir: The verifier's weights on this machine.
        hidden_states: Every file of the layout and what each must hold (resume checks finished files against it).
        extraction: The finished files so far (``store: files``).
        todo: The files still to write.
    """

    params: ExtractParams
    verifier: VerifierInfo
    model_dir: Path
    hidden_states: HiddenStatePlan
    extraction: Extraction | None = None
    todo: tuple[ShardSpec, ...] = ()

    @property
    def input_ids(self) -> list[list[int]]:
        """Token ids of every prepared row."""
        return self.hidden_states.input_ids

    def layout(self, spec: ShardSpec) -> FileLayout:
        """Every byte of ``spec``'s file but its rows' hidden states."""
        return self.hidden_states.layout(spec)


def plan_extraction(params: ExtractParams, verifier_dir: Path, prepared_dir: Path, out_dir: Path) -> ExtractionPlan:
    """Phase 1: the layout's files, the finished ones kept (checked), the rest to write."""
    verifier, model_dir = load_verifier_info(verifier_dir)
    input_ids = load_input_ids(prepared_dir)
    _check_rows(input_ids, verifier)
    hidden_states = HiddenStatePlan(
        input_ids,
        params.rows_per_shard,
        verifier.layer_ids,
        verifier.hidden_size,
        verifier.fingerprint,
        params.dtype,
        params.backend,
    )
    if params.store != "files":  # online, stream: nothing stored
        return ExtractionPlan(params, verifier, model_dir, hidden_states)
    extraction = Extraction(out_dir, hidden_states)
    todo = extraction.collect()
    log.info(
        "%d rows in %d files: %d files already finished, %d to write; %d stale files removed",
        len(input_ids),
        len(hidden_states.files),
        len(hidden_states.files) - len(todo),
        len(todo),
        extraction.removed,
    )
    return ExtractionPlan(params, verifier, model_dir, hidden_states, extraction, tuple(todo))


@dataclass
class Computed:
    """What phase 2 did: rows computed, seconds, and where."""

    rows: int = 0
    tokens: int = 0
    seconds: float = 0.0
    executor: str = "local"
    engines: int = 0


def compute_hidden_states(plan: ExtractionPlan, cluster: ClusterParams) -> Computed:
    """Phase 2: the files whose rows earlier files hold are assembled from them; the rest are computed by
    ``cluster.executor``, in tasks of about ``ROWS_PER_TASK`` rows (:func:`plan_tasks`), and each finished file is
    written into the unfinished folder."""
    params, extraction = plan.params, plan.extraction
    assert extraction is not None
    started = time.perf_counter()
    to_compute = []
    for spec in plan.todo:
        if extraction.can_copy(spec):
            extraction.copy_from_earlier(plan.layout(spec))
        else:
            to_compute.append(spec)
    if len(to_compute) < len(plan.todo):
        log.info(
            "%d files assembled from the rows of earlier files, nothing computed", len(plan.todo) - len(to_compute)
        )
    if params.backend == "import":
        cluster = in_this_process(cluster, "extract.backend: import copies files on this machine")
    computed = Computed(
        rows=sum(len(spec.rows) for spec in to_compute),
        tokens=sum(len(plan.input_ids[row]) for spec in to_compute for row in spec.rows),
        executor=cluster.executor,
    )
    if to_compute:
        with open_executor(cluster, engine_needs(params)) as executor:
            computed.engines = executor.workers
            try:
                _run_tasks(plan, executor, to_compute, computed)
            finally:
                extraction.abort_unfinished()  # a stopped run: shards with rows missing are computed again next time
    computed.seconds = time.perf_counter() - started
    return computed


def plan_tasks(
    plan: ExtractionPlan, specs: list[ShardSpec], destination: Path | None, rows_to_driver: bool
) -> list[ExtractTask] | list[RowTask]:
    """The tasks that compute ``specs``, cut from the layout alone (what is left to compute, the executor and its
    engines do not move a cut), so every executor runs the same tasks and writes the same bytes.

    Args:
        plan: The extraction.
        specs: The files to compute.
        destination: Where tasks of whole files write them (a shared folder), or None (their bytes come back).
        rows_to_driver: Whether tasks may return their rows to this process (its engines run here, or results
            travel back to it): then each shard is cut into :class:`RowTask` s; else each task writes whole files
            (a shard each, where workers write into a shared folder).
    """
    if rows_to_driver and not specs[0].row_files:
        return [task for spec in specs for task in row_tasks(plan.layout(spec), plan.params)]
    return [
        ExtractTask(tuple(plan.layout(spec) for spec in group), plan.params.dtype, destination)
        for group in task_groups(specs)
    ]


def _run_tasks(
    plan: ExtractionPlan, executor: Executor[Any, Any, Any], specs: list[ShardSpec], computed: Computed
) -> None:
    """Runs the tasks of ``specs`` (``computed``'s rows) on ``executor``; each result is written into the unfinished
    folder here."""
    from eaglenest.core.progress import progress

    params, extraction = plan.params, plan.extraction
    assert extraction is not None
    destination = executor.results_folder(extraction.dir)
    tasks = plan_tasks(plan, specs, destination, rows_to_driver=destination is None or executor.runs_in_driver)
    log.info("%d files to compute in %d tasks (%s executor)", len(specs), len(tasks), computed.executor)
    names = {spec.name: spec for spec in specs}
    with progress(computed.rows, f"hidden states ({params.backend}, {computed.executor})", "row") as bar:

        def on_result(task: ExtractTask | RowTask, result: list[tuple[Any, Any]]) -> None:
            if isinstance(task, RowTask):
                extraction.accept_rows(task.spec, result)
            else:
                for name, value in result:  # whole files: written by the worker, or their bytes
                    if isinstance(value, Path):
                        extraction.accept_file(names[name])
                    else:
                        extraction.accept_bytes(names[name], value)
            bar.update(len(task.rows))

        # A staging folder beside the output only where the engine runs on this machine.
        staging = staging_dir_for(extraction.out_dir) if executor.runs_in_driver else None
        settings = EngineSettings(
            plan.verifier, plan.model_dir.resolve(), params, max(len(ids) for ids in plan.input_ids), staging=staging
        )
        run_task = run_row_task if tasks and isinstance(tasks[0], RowTask) else run_extract_task
        executor.run(functools.partial(make_engine, settings), run_task, tasks, on_result)


def computed_in(params: ExtractParams, model_dir: Path) -> str | None:
    """The dtype the host record names for this extraction: the one the verifier computed in here, whatever
    ``extract.dtype`` stores. hf: its decoder's on its device (bf16 on a GPU, float32 on a CPU); vllm: the engine's
    (``extract.vllm.dtype``, "auto" resolved as :func:`~eaglenest.core.vllm_support.serving_dtype` resolves it for
    vLLM, else the checkpoint's own); import: None, the states were computed elsewhere and only copied here."""
    if params.backend == "import":
        return None
    if params.backend == "vllm":
        from eaglenest.core.vllm_support import checkpoint_dtype, serving_dtype

        dtype = serving_dtype(model_dir, params.vllm.dtype)
        return checkpoint_dtype(model_dir) if dtype == "auto" else dtype
    from eaglenest.core.decoder import decoder_dtype
    from eaglenest.core.device import pick_device

    return str(decoder_dtype(pick_device(params.device, "extract.device"))).removeprefix("torch.")


def finish_extraction(plan: ExtractionPlan, computed: Computed, metrics_path: Path) -> dict[str, Any]:
    """Phase 3: every file is finished: into ``data/hidden_states``, and the metrics."""
    params, input_ids, extraction = plan.params, plan.input_ids, plan.extraction
    assert extraction is not None
    size = extraction.stored_size()
    extraction.finish()
    tokens = sum(len(ids) for ids in input_ids)
    metrics = {
        "store": params.store,
        "rows": len(input_ids),
        "rows_per_shard": params.rows_per_shard,
        "files": len(plan.hidden_states.files),
        "rows_computed": computed.rows,
        "rows_reused": len(input_ids) - computed.rows,
        "tokens": tokens,
        "seconds": round(computed.seconds, 3),
        # Throughput of what this run computed, engine start included; null when nothing was computed.
        "tokens_per_s": round(computed.tokens / computed.seconds, 1) if computed.tokens else None,
        "bytes": size,
        "bytes_per_token": round(size / tokens, 1) if tokens else None,
        "dtype": params.dtype,
        "backend": params.backend,
        "executor": computed.executor,
        "engines": computed.engines,
        # kernels differ by CPU kind: the same commit extracts other bytes on another kind
        "host": host_record(computed_in(params, plan.model_dir)),
    }
    atomic_write_json(metrics_path, metrics)
    return metrics


def extract_hidden_states(
    params: ExtractParams,
    verifier_dir: Path,
    prepared_dir: Path,
    out_dir: Path,
    metrics_path: Path,
    cluster: ClusterParams | None = None,
) -> dict[str, Any]:
    """The extract stage's work: plan, compute what is missing, finish; returns the metrics it writes.

    Args:
        params: The extract params.
        verifier_dir: The verifier stage's output folder.
        prepared_dir: The prepare stage's dataset folder.
        out_dir: ``data/hidden_states``.
        metrics_path: ``metrics/extract.json``.
        cluster: Where the work runs; None: this process.
    """
    cluster = cluster or ClusterParams()
    if params.backend != "import" and params.store == "files":
        check_cluster(cluster)  # before any work: a cluster that is not there is one line
    unfinished = unfinished_dir(out_dir)
    with exclusive(lock_file_for(unfinished), str(unfinished)):
        plan = plan_extraction(params, verifier_dir, prepared_dir, out_dir)
        if params.store != "files":
            return _write_online_manifest(params, plan.verifier, plan.input_ids, out_dir, metrics_path)
        computed = compute_hidden_states(plan, cluster)
        return finish_extraction(plan, computed, metrics_path)


def _write_online_manifest(
    params: ExtractParams, verifier: VerifierInfo, input_ids: list[list[int]], out_dir: Path, metrics_path: Path
) -> dict[str, Any]:
    """``extract.store: online`` or ``stream``: no hidden states, only the manifest the train stage computes them
    against (a stream's with the extract params its engines are built from).

    Files of an earlier ``store: files`` run, finished or not, are deleted: keeping them would keep their terabytes
    in the workspace for nothing (``dvc checkout`` of that commit brings them back).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    removed = remove_stale_temps(out_dir)
    for path in stored_files(out_dir):
        path.unlink()
        removed += 1
    shutil.rmtree(unfinished_dir(out_dir), ignore_errors=True)
    extract = params.model_dump(mode="json") if params.store == "stream" else None
    manifest = online_manifest(verifier, params.dtype, input_ids, params.store, extract)
    atomic_write_json(out_dir / MANIFEST_FILE, manifest)
    log.info(
        "extract.store: %s: %d rows (%d tokens) will be computed by the train stage; %d stored files removed",
        params.store,
        manifest["rows"],
        manifest["tokens"],
        removed,
    )
    size = (out_dir / MANIFEST_FILE).stat().st_size
    metrics = {
        "store": params.store,
        "rows": len(input_ids),
        "rows_computed": 0,
        "rows_reused": 0,
        "tokens": manifest["tokens"],
        "seconds": 0.0,
        "tokens_per_s": None,
        "bytes": size,
        "bytes_per_token": round(size / max(1, int(manifest["tokens"])), 4),
        "dtype": params.dtype,
        "backend": params.backend,
    }
    atomic_write_json(metrics_path, metrics)
    return metrics


@dataclass(frozen=True)
class ExtractPaths(PreparedInput):
    """Where dvc.yaml puts the extract stage's inputs and outputs."""

    out: Path = path_arg("hidden-state folder (data/hidden_states)")
    metrics: Path = path_arg("metrics JSON (metrics/extract.json)")


def run(params: ExtractStageParams, paths: ExtractPaths) -> dict[str, Any]:
    """The extract stage, on ``cluster.executor``."""
    return extract_hidden_states(
        params.extract, paths.verifier, paths.prepared, paths.out, paths.metrics, params.cluster
    )


STAGE = Stage(
    "extract", "The verifier's hidden states for every prepared row (resumable).", ExtractStageParams, ExtractPaths, run
)
