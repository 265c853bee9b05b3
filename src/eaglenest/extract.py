"""The extract stage: the verifier's hidden states for every prepared row, resumable.

The stage's output ``data/hidden_states/`` is declared ``persist: true`` in dvc.yaml. DVC normally deletes
a stage's outputs before re-running it; persisting them is what lets a rerun — after a kill -9, after a
changed param, or after ``dvc repro`` decided the stage changed — keep every finished file that still
validates and compute only what is missing. Validity is decided per file (see
:mod:`eaglenest.hidden_states`): a readable header with the right keys, dtypes and shapes, a length on
disk that matches the header, metadata naming the current verifier / layers / dtype, and ``token_ids``
equal to the prepared row. Anything else is recomputed; files for rows that no longer exist and
temporaries left by a killed run are deleted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eaglenest.atomic import atomic_write_json, remove_stale_temps
from eaglenest.errors import EaglenestError
from eaglenest.hidden_states import (
    HIDDEN_KEY,
    TOKENS_KEY,
    TORCH_DTYPES,
    check_header,
    extraction_fingerprint,
    file_metadata,
    hs_path,
    row_index,
    write_hidden_states,
)
from eaglenest.params import ExtractParams
from eaglenest.registry import Registry
from eaglenest.verifier import VerifierInfo, load_verifier_info

log = logging.getLogger(__name__)


@dataclass
class ExtractionJob:
    """Everything a back end needs, and the one way it hands results back (:meth:`write`).

    Attributes:
        verifier: The verifier stage's record.
        model_dir: The verifier's weights on this machine.
        params: The extract params.
        out_dir: ``data/hidden_states``.
        todo: Prepared row indices to compute, in any order.
        input_ids: Token ids of every prepared row (indexed by row).
        on_row: Called after each row is written with (row, tokens); drives the progress bar.
    """

    verifier: VerifierInfo
    model_dir: Path
    params: ExtractParams
    out_dir: Path
    todo: list[int]
    input_ids: list[list[int]]
    on_row: Callable[[int, int], None] = lambda row, tokens: None
    bytes_written: int = 0
    metadata: dict[str, str] = field(default_factory=dict)

    def write(self, row: int, hidden_states: torch.Tensor) -> None:
        """Stores one row's ``[seq, n_aux + 1, hidden]`` hidden states atomically, in the storage dtype."""
        expected = (len(self.input_ids[row]), len(self.verifier.layer_ids), self.verifier.hidden_size)
        if tuple(hidden_states.shape) != expected:
            raise EaglenestError(
                f"{self.params.backend} back end returned hidden states of shape {tuple(hidden_states.shape)} "
                f"for row {row}, expected {expected}"
            )
        tokens = torch.tensor(self.input_ids[row], dtype=torch.int64)
        stored = hidden_states.to(device="cpu", dtype=TORCH_DTYPES[self.params.dtype])
        self.bytes_written += write_hidden_states(hs_path(self.out_dir, row), stored, tokens, self.metadata)
        self.on_row(row, len(tokens))


Backend = Callable[[ExtractionJob], None]


def _hf_backend(job: ExtractionJob) -> None:
    from eaglenest.extract_hf import extract_with_transformers

    extract_with_transformers(job)


def _vllm_backend(job: ExtractionJob) -> None:
    from eaglenest.extract_vllm import extract_with_vllm  # imports vllm: GPU machines only

    extract_with_vllm(job)


def _import_backend(job: ExtractionJob) -> None:
    """Copies ``hs_{row}.safetensors`` from extract.import_path, checking tokens, shape and values."""
    from eaglenest.convert import read_hidden_state_file

    source = Path(job.params.import_path or "")
    if not source.is_dir():
        raise EaglenestError(f"extract.import_path = {str(source)!r}: no such folder")
    for row in job.todo:
        path = hs_path(source, row)
        # Any float dtype is accepted here: job.write converts to extract.dtype.
        problem, data = read_hidden_state_file(path, job.input_ids[row], job.verifier, None)
        if problem is not None:
            raise EaglenestError(f"{path}: {problem}")
        job.write(row, data[HIDDEN_KEY])


BACKENDS: Registry[Backend] = Registry("extract back end")
BACKENDS.register("hf", _hf_backend)
BACKENDS.register("vllm", _vllm_backend)
BACKENDS.register("import", _import_backend)


def shard_rows(num_rows: int, rank: int, world_size: int) -> range:
    """The contiguous slice of rows that node ``rank`` of ``world_size`` extracts."""
    return range(num_rows * rank // world_size, num_rows * (rank + 1) // world_size)


def file_is_valid(path: Path, input_ids: list[int], verifier: VerifierInfo, dtype: str, config: str) -> bool:
    """True if ``path`` holds this row's hidden states for this configuration (header + token ids)."""
    problem = check_header(path, seq_len=len(input_ids), num_slots=len(verifier.layer_ids),
                           hidden_size=verifier.hidden_size, dtype=dtype, config=config)
    if problem is not None:
        if problem != "missing":
            log.info("recomputing %s: %s", path.name, problem)
        return False
    try:
        with safe_open(str(path), framework="pt") as fh:
            tokens = fh.get_tensor(TOKENS_KEY)
    except (OSError, ValueError, RuntimeError) as err:  # safetensors raises SafetensorError(Exception)
        log.info("recomputing %s: %s", path.name, err)
        return False
    if tokens.tolist() != input_ids:
        log.info("recomputing %s: token_ids differ from the prepared row", path.name)
        return False
    return True


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
    removed = remove_stale_temps(out_dir)
    for path in out_dir.glob("hs_*.safetensors"):
        index = row_index(path)
        if index is not None and index >= len(input_ids):  # left over from a larger dataset
            path.unlink()
            removed += 1
    config = extraction_fingerprint(verifier.fingerprint, verifier.layer_ids, params.dtype)
    todo = [row for row in rows
            if not file_is_valid(hs_path(out_dir, row), input_ids[row], verifier, params.dtype, config)]
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
    tokens = sum(len(input_ids[row]) for row in rows)
    size = sum(hs_path(out_dir, row).stat().st_size for row in rows)
    metrics = {
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
