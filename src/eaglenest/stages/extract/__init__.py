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
)
from eaglenest.artifacts.verifier import VerifierInfo, load_verifier_info
from eaglenest.core.atomic import atomic_write_json, remove_stale_temps
from eaglenest.core.errors import EaglenestError
from eaglenest.core.params import ExtractParams, parse_params
from eaglenest.core.registry import Registry
from eaglenest.stages.extract.job import Backend, ExtractionJob
from eaglenest.stages.extract.shards import SHARDS_DIR, check_join, check_shard_start, shard_rows, write_record

__all__ = ["BACKENDS", "extract_hidden_states", "shard_params", "shard_rows"]

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


def shard_params(params: ExtractParams, rank: int | None, world_size: int | None) -> ExtractParams:
    """``params`` with the shard given on the command line, validated as params are (one line naming both)."""
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
                    config: str) -> list[int]:
    """The rows of ``rows`` without a valid file; why each existing file is recomputed is logged, the first
    ``SHOW_RECOMPUTED`` by name and the rest counted per reason."""
    todo: list[int] = []
    reasons: Counter[str] = Counter()
    for row in rows:
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


def extract_hidden_states(params: ExtractParams, verifier_dir: Path, prepared_dir: Path, out_dir: Path,
                          metrics_path: Path) -> dict[str, Any]:
    """The extract stage; returns the metrics it writes."""
    from datasets import load_from_disk
    from tqdm import tqdm

    verifier, model_dir = load_verifier_info(verifier_dir)
    try:
        dataset = load_from_disk(str(prepared_dir))
    except FileNotFoundError:
        raise EaglenestError(f"{prepared_dir}: no prepared dataset; run `dvc repro prepare` first") from None
    input_ids: list[list[int]] = dataset.data.column("input_ids").to_pylist()
    rows = shard_rows(len(input_ids), params.rank, params.world_size)
    _check_context(input_ids, rows, verifier)

    out_dir.mkdir(parents=True, exist_ok=True)
    if params.store == "online":
        return _write_online_manifest(params, verifier, input_ids, out_dir, metrics_path)
    (out_dir / MANIFEST_FILE).unlink(missing_ok=True)  # files again: a manifest would say "online"
    # Shards on several nodes may share one folder: each clears only the temporaries of its own rows.
    removed = remove_stale_temps(out_dir, mine=lambda name: row_index(Path(name)) in rows)
    for path in out_dir.glob("hs_*.safetensors"):
        index = row_index(path)
        if index is not None and index >= len(input_ids):  # left over from a larger dataset
            path.unlink()
            removed += 1
    config = extraction_fingerprint(verifier.fingerprint, verifier.layer_ids, params.dtype)
    if params.world_size > 1:
        check_shard_start(out_dir, params.rank, params.world_size, rows, len(input_ids), config)
    else:  # the join of a multi-node extraction, or a plain single-node run
        check_join(out_dir, len(input_ids), config)
    todo = rows_to_compute(out_dir, rows, input_ids, verifier, params.dtype, config)
    log.info("%d rows in shard %d/%d: %d already extracted, %d to compute; %d stale files removed",
             len(rows), params.rank, params.world_size, len(rows) - len(todo), len(todo), removed)

    todo_tokens = sum(len(input_ids[row]) for row in todo)
    started = time.perf_counter()
    with tqdm(total=len(todo), desc=f"extract ({params.backend})", unit="row") as bar:
        done_tokens = 0

        def on_row(row: int, tokens: int) -> None:
            nonlocal done_tokens
            done_tokens += tokens
            bar.update(1)
            bar.set_postfix(tok_s=f"{done_tokens / max(time.perf_counter() - started, 1e-9):.0f}")

        job = ExtractionJob(verifier=verifier, model_dir=model_dir, params=params, out_dir=out_dir, todo=todo,
                            input_ids=input_ids, on_row=on_row,
                            metadata=file_metadata(config, verifier.layer_ids, params.dtype, params.backend))
        if todo:
            BACKENDS.get(params.backend)(job)
    seconds = time.perf_counter() - started

    missing = [row for row in rows if not hs_path(out_dir, row).is_file()]
    if missing:
        raise EaglenestError(f"{len(missing)} rows have no hidden states after extraction (first: row {missing[0]})")
    if params.world_size > 1:
        write_record(out_dir, params.rank, params.world_size, rows, len(input_ids), config)
    tokens = sum(len(input_ids[row]) for row in rows)
    size = sum(hs_path(out_dir, row).stat().st_size for row in rows)
    metrics = {
        "store": params.store,
        "rows": len(rows),
        "rows_computed": len(todo),
        "rows_reused": len(rows) - len(todo),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        # Throughput of what this run computed; null when everything was already there.
        "tokens_per_s": round(todo_tokens / seconds, 1) if todo else None,
        "bytes": size,
        "bytes_per_token": round(size / tokens, 1),
        "dtype": params.dtype,
        "backend": params.backend,
    }
    atomic_write_json(metrics_path, metrics)
    return metrics


def _write_online_manifest(params: ExtractParams, verifier: VerifierInfo, input_ids: list[list[int]], out_dir: Path,
                           metrics_path: Path) -> dict[str, Any]:
    """``extract.store: online``: no hidden states, only the manifest the train stage computes them against.

    Files of an earlier ``store: files`` run are deleted: the folder is a DVC output, and keeping them would
    keep their terabytes in the workspace and cache for nothing (``dvc checkout`` of that commit brings them
    back).
    """
    removed = remove_stale_temps(out_dir)
    for path in out_dir.glob("hs_*.safetensors"):
        path.unlink()
        removed += 1
    shutil.rmtree(out_dir / SHARDS_DIR, ignore_errors=True)
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
