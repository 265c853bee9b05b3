"""The extract stage: the verifier's hidden states for every prepared row, resumable.

The stage's output ``data/hidden_states/`` is declared ``persist: true`` in dvc.yaml. DVC normally deletes
a stage's outputs before re-running it; persisting them is what lets a rerun — after a kill -9, after a
changed param, or after ``dvc repro`` decided the stage changed — keep every finished file that still
validates and compute only what is missing. Validity is decided per file (see
:mod:`eaglenest.artifacts.hidden_states`): a readable header with the right keys, dtypes and shapes, a length on
disk that matches the header, metadata naming the current verifier / layers / dtype, and ``token_ids``
equal to the prepared row. Anything else is recomputed; files for rows that no longer exist and
temporaries left by a killed run are deleted.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

from eaglenest.artifacts.hidden_states import (
    MANIFEST_FILE,
    TOKENS_KEY,
    check_header,
    extraction_fingerprint,
    file_metadata,
    hs_path,
    online_manifest,
    row_index,
    shard_number,
    shards_of,
    stored_files,
)
from eaglenest.artifacts.prepared import load_input_ids
from eaglenest.artifacts.verifier import VerifierInfo, load_verifier_info
from eaglenest.core.atomic import atomic_write_json, remove_stale_temps
from eaglenest.core.errors import EaglenestError
from eaglenest.core.params import ExtractParams, Params, parse_params
from eaglenest.core.registry import Registry
from eaglenest.core.stage import Stage, int_option, path_arg
from eaglenest.stages.extract.job import Backend, ExtractionJob
from eaglenest.stages.extract.parts import PARTS_DIR, check_join, check_part_start, part_rows, write_record
from eaglenest.stages.extract.sharding import ShardPacker, missing_rows, plan_shards, stored_size

log = logging.getLogger(__name__)


BACKENDS: Registry[Backend] = Registry("extract back end")


@BACKENDS.entry("hf")
def _hf(job: ExtractionJob) -> None:
    from eaglenest.stages.extract.hf import extract_with_transformers

    extract_with_transformers(job)


@BACKENDS.entry("vllm")
def _vllm(job: ExtractionJob) -> None:
    from eaglenest.stages.extract.vllm import extract_with_vllm  # imports vllm once its engine starts

    extract_with_vllm(job)


@BACKENDS.entry("import")
def _import(job: ExtractionJob) -> None:
    from eaglenest.stages.extract.imported import copy_hidden_state_files

    copy_hidden_state_files(job)


def part_params(params: ExtractParams, rank: int | None, world_size: int | None) -> ExtractParams:
    """``params`` with the part given on the command line, validated as params are (one line naming both)."""
    values = params.model_dump()
    values.update({k: v for k, v in (("rank", rank), ("world_size", world_size)) if v is not None})
    return parse_params({"extract": values}, source="--rank/--world-size").extract


# Files recomputed for one reason are logged this many times by name, then counted: a changed dtype or verifier
# invalidates every file, and a million log lines would hide everything else.
SHOW_RECOMPUTED = 3


def file_problem(path: Path, input_ids: list[int], verifier: VerifierInfo, dtype: str, config: str) -> str | None:
    """Why ``path`` does not hold this row's hidden states for this configuration (header, then token ids), or
    None when it does; "missing" when there is no file."""
    problem = check_header(path, seq_len=len(input_ids), num_slots=len(verifier.layer_ids),
                           hidden_size=verifier.hidden_size, dtype=dtype, config=config)
    if problem is not None:
        return problem
    try:
        with safe_open(str(path), framework="pt") as fh:
            tokens = fh.get_tensor(TOKENS_KEY)
    except (OSError, ValueError, RuntimeError) as err:  # safetensors raises SafetensorError(Exception)
        return str(err)
    if tokens.tolist() != input_ids:
        return "token_ids differ from the prepared row"
    return None


def rows_to_compute(out_dir: Path, rows: range, input_ids: list[list[int]], verifier: VerifierInfo, dtype: str,
                    config: str, skip: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """The rows of ``rows`` (but ``skip``, already in shards) without a valid row file; why each existing file is
    recomputed is logged, the first ``SHOW_RECOMPUTED`` by name and the rest counted per reason."""
    todo: list[int] = []
    reasons: Counter[str] = Counter()
    for row in rows:
        if row in skip:
            continue
        path = hs_path(out_dir, row)
        problem = file_problem(path, input_ids[row], verifier, dtype, config)
        if problem is None:
            continue
        todo.append(row)
        if problem != "missing":
            reasons[problem] += 1
            if reasons[problem] <= SHOW_RECOMPUTED:
                log.info("recomputing %s: %s", path.name, problem)
    for problem, count in reasons.items():
        if count > SHOW_RECOMPUTED:
            log.info("recomputing %d files in all: %s", count, problem)
    return todo


def _check_context(input_ids: list[list[int]], rows: range, verifier: VerifierInfo) -> None:
    limit = verifier.max_position_embeddings
    if limit is None:
        return
    too_long = [(row, len(input_ids[row])) for row in rows if len(input_ids[row]) > limit]
    if too_long:
        row, length = too_long[0]
        raise EaglenestError(
            f"prepared row {row} has {length} tokens, more than the verifier's context of {limit} "
            f"({len(too_long)} rows in all); set prepare.max_len <= {limit}"
        )


@dataclass(frozen=True)
class ExtractionPlan:
    """What this run of the extract stage must do (the first phase's result).

    Attributes:
        params: The extract params (with this node's part).
        verifier: The verifier stage's record.
        model_dir: The verifier's weights on this machine.
        input_ids: Token ids of every prepared row.
        rows: This node's rows (all of them on one node).
        todo: The rows of ``rows`` without a valid file, to compute.
        config: The extraction fingerprint every file records.
        in_shards: Rows already held by valid shards (``extract.rows_per_shard`` > 1).
    """

    params: ExtractParams
    verifier: VerifierInfo
    model_dir: Path
    input_ids: list[list[int]]
    rows: range
    todo: list[int]
    config: str
    in_shards: frozenset[int] = frozenset()

    @property
    def metadata(self) -> dict[str, str]:
        """The metadata every row file of this run records."""
        return file_metadata(self.config, self.verifier.layer_ids, self.params.dtype, self.params.backend)


def _mine(name: str, rows: range, rows_per_shard: int) -> bool:
    """Whether a temporary written for file ``name`` belongs to this node's rows."""
    row, shard = row_index(Path(name)), shard_number(Path(name))
    if shard is not None:
        return shard * rows_per_shard in rows
    return row in rows


def plan_extraction(params: ExtractParams, verifier_dir: Path, prepared_dir: Path, out_dir: Path) -> ExtractionPlan:
    """Phase 1: which rows this node extracts, what already validates, and the stale files cleared away."""
    verifier, model_dir = load_verifier_info(verifier_dir)
    input_ids = load_input_ids(prepared_dir)
    rows = part_rows(len(input_ids), params.rank, params.world_size, params.rows_per_shard)
    _check_context(input_ids, rows, verifier)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = extraction_fingerprint(verifier.fingerprint, verifier.layer_ids, params.dtype)
    if params.store == "online":
        return ExtractionPlan(params, verifier, model_dir, input_ids, rows, [], config)
    (out_dir / MANIFEST_FILE).unlink(missing_ok=True)  # files again: a manifest would say "online"
    # Parts on several nodes may share one folder: each clears only the temporaries of its own rows.
    removed = remove_stale_temps(out_dir, mine=lambda name: _mine(name, rows, params.rows_per_shard))
    if params.world_size > 1:
        if not rows:
            log.warning("part %d/%d holds no whole shard: %d rows in shards of %d are fewer shards than the %d "
                        "nodes, so this node computes nothing (a smaller extract.rows_per_shard spreads them)",
                        params.rank, params.world_size, len(input_ids), params.rows_per_shard, params.world_size)
        check_part_start(out_dir, params.rank, params.world_size, rows, len(input_ids), config)
    else:  # the join of a multi-node extraction, or a plain single-node run
        check_join(out_dir, len(input_ids), config, params.rows_per_shard)
    metadata = file_metadata(config, verifier.layer_ids, params.dtype, params.backend)
    in_shards = plan_shards(out_dir, rows, input_ids, verifier, params.dtype, config, params.rows_per_shard,
                            metadata)
    for path in out_dir.glob("hs_*.safetensors"):
        index = row_index(path)
        # left over from a larger dataset, or already in a shard (a run killed while it packed)
        if index is not None and (index >= len(input_ids) or index in in_shards):
            path.unlink()
            removed += 1
    todo = rows_to_compute(out_dir, rows, input_ids, verifier, params.dtype, config,
                           skip=in_shards)
    log.info("%d rows in part %d/%d: %d already extracted, %d to compute; %d stale files removed",
             len(rows), params.rank, params.world_size, len(rows) - len(todo), len(todo), removed)
    return ExtractionPlan(params, verifier, model_dir, input_ids, rows, todo, config, frozenset(in_shards))


def compute_hidden_states(plan: ExtractionPlan, out_dir: Path) -> float:
    """Phase 2: the back end computes every row of ``plan.todo`` and writes its file; returns the seconds."""
    from eaglenest.core.progress import progress

    params, input_ids = plan.params, plan.input_ids
    started = time.perf_counter()
    packer = None
    if params.rows_per_shard > 1:
        packer = ShardPacker(out_dir, plan.rows, len(input_ids), params.rows_per_shard, set(plan.in_shards),
                             plan.todo, plan.metadata)
        packer.pack_ready()  # shards whose rows an interrupted run finished
    with progress(len(plan.todo), f"extract ({params.backend})", "row") as bar:
        done_tokens = 0

        def on_row(row: int, tokens: int) -> None:
            nonlocal done_tokens
            done_tokens += tokens
            if packer is not None:  # rows finish in any order: a shard is packed after its last
                packer.row_done(row)
            bar.update(1)
            bar.set_postfix(tok_s=f"{done_tokens / max(time.perf_counter() - started, 1e-9):.0f}")

        job = ExtractionJob(verifier=plan.verifier, model_dir=plan.model_dir, params=params, out_dir=out_dir,
                            todo=plan.todo, input_ids=input_ids, on_row=on_row, metadata=plan.metadata)
        if plan.todo:
            BACKENDS.get(params.backend)(job)
    return time.perf_counter() - started


def finish_extraction(plan: ExtractionPlan, out_dir: Path, metrics_path: Path, seconds: float) -> dict[str, Any]:
    """Phase 3: every row of the part has its file; the part's record (several nodes) and the metrics."""
    params, input_ids, rows = plan.params, plan.input_ids, plan.rows
    missing = missing_rows(out_dir, rows, len(input_ids), params.rows_per_shard)
    if missing:
        raise EaglenestError(f"{len(missing)} rows have no hidden states after extraction (first: row {missing[0]})")
    if params.world_size > 1:
        write_record(out_dir, params.rank, params.world_size, rows, len(input_ids), plan.config)
    tokens = sum(len(input_ids[row]) for row in rows)
    todo_tokens = sum(len(input_ids[row]) for row in plan.todo)
    size = stored_size(out_dir, rows, len(input_ids), params.rows_per_shard)
    metrics = {
        "store": params.store,
        "rows": len(rows),
        "rows_per_shard": params.rows_per_shard,
        "files": len(rows) if params.rows_per_shard == 1 else len(shards_of(rows, params.rows_per_shard)),
        "rows_computed": len(plan.todo),
        "rows_reused": len(rows) - len(plan.todo),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        # Throughput of what this run computed; null when everything was already there.
        "tokens_per_s": round(todo_tokens / seconds, 1) if plan.todo else None,
        "bytes": size,
        "bytes_per_token": round(size / tokens, 1) if tokens else None,  # a part may get no whole shard
        "dtype": params.dtype,
        "backend": params.backend,
    }
    atomic_write_json(metrics_path, metrics)
    return metrics


def extract_hidden_states(params: ExtractParams, verifier_dir: Path, prepared_dir: Path, out_dir: Path,
                          metrics_path: Path) -> dict[str, Any]:
    """The extract stage's work: plan, compute what is missing, finish; returns the metrics it writes."""
    plan = plan_extraction(params, verifier_dir, prepared_dir, out_dir)
    if params.store == "online":
        return _write_online_manifest(params, plan.verifier, plan.input_ids, out_dir, metrics_path)
    seconds = compute_hidden_states(plan, out_dir)
    return finish_extraction(plan, out_dir, metrics_path, seconds)


def _write_online_manifest(params: ExtractParams, verifier: VerifierInfo, input_ids: list[list[int]], out_dir: Path,
                           metrics_path: Path) -> dict[str, Any]:
    """``extract.store: online``: no hidden states, only the manifest the train stage computes them against.

    Files of an earlier ``store: files`` run are deleted: the folder is a DVC output, and keeping them would
    keep their terabytes in the workspace and cache for nothing (``dvc checkout`` of that commit brings them
    back).
    """
    removed = remove_stale_temps(out_dir)
    for path in stored_files(out_dir):
        path.unlink()
        removed += 1
    shutil.rmtree(out_dir / PARTS_DIR, ignore_errors=True)
    manifest = online_manifest(verifier, params.dtype, input_ids)
    atomic_write_json(out_dir / MANIFEST_FILE, manifest)
    log.info("extract.store: online: %d rows (%d tokens) will be computed by the train stage; %d stored files "
             "removed", manifest["rows"], manifest["tokens"], removed)
    size = (out_dir / MANIFEST_FILE).stat().st_size
    metrics = {
        "store": "online",
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
class ExtractPaths:
    """Where dvc.yaml puts the extract stage's inputs and outputs, and a node's part (multi-node extraction)."""

    verifier: Path = path_arg("the verifier stage's output folder")
    prepared: Path = path_arg("the prepare stage's dataset folder")
    out: Path = path_arg("hidden-state folder (data/hidden_states)")
    metrics: Path = path_arg("metrics JSON (metrics/extract.json)")
    rank: int | None = int_option("this node's part (overrides extract.rank)")
    world_size: int | None = int_option("the number of parts (overrides extract.world_size)")


def run(params: Params, paths: ExtractPaths) -> dict[str, Any]:
    """The extract stage, on this node's part when ``--rank`` / ``--world-size`` are given (README)."""
    extract = params.extract
    if paths.rank is not None or paths.world_size is not None:
        extract = part_params(extract, paths.rank, paths.world_size)
    return extract_hidden_states(extract, paths.verifier, paths.prepared, paths.out, paths.metrics)


STAGE = Stage("extract", "The verifier's hidden states for every prepared row (resumable).", ExtractPaths, run)
