"""The convert stage: validate every hidden-state file, build the draft vocabulary, count the data.

Validation reads every ``hs_{i}.safetensors`` in full: header (keys, dtypes, shape ``[seq, n_aux + 1,
hidden]`` against the verifier stage's record, length on disk), ``token_ids`` equal to the prepared
``input_ids``, every value finite, and the file's data against the checksum its header records (taken as extract
wrote it: a file that lost its data to a power loss after its rename holds finite zeros under a good header).
Shards are checked the same way row by row, after their header and row index; a bad row is named as its shard and
row, and a shard whose data fails its checksum has every row named (which of its rows lost their bytes is
unknown). The layout (row files, or shards of which size) is read from the files themselves
(:func:`eaglenest.artifacts.hidden_states.reader.open_stored`), not from ``extract.rows_per_shard``. With
``convert.on_bad: fail`` any bad row stops the stage with the first offenders listed; with ``skip`` those rows (not
their whole shard, unless its checksum fails) are excluded from training and listed in ``data/vocab/rows.json`` and
``metrics/data.json``.

The draft vocabulary is speculators' own construction (``build_vocab_mappings_from_distribution``): the
most frequent loss-masked tokens of the *train* split, ties by id, filled deterministically with the
lowest unused ids when fewer distinct tokens were seen; its files are :mod:`eaglenest.artifacts.vocab`'s.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eaglenest.artifacts.hidden_states.format import (
    ROW_INDEX_KEY,
    TOKENS_KEY,
    HiddenStateFileError,
    check_shard_header,
    checked_hidden_states,
    checksum_problem,
    read_hidden_state_file,
    read_shard_row,
    row_digest,
    verify_checksum,
)
from eaglenest.artifacts.hidden_states.layout import ShardSpec
from eaglenest.artifacts.hidden_states.online import MANIFEST_FILE, read_online_manifest
from eaglenest.artifacts.hidden_states.reader import StoredHiddenStates, open_stored
from eaglenest.artifacts.prepared import load_split, load_table
from eaglenest.artifacts.verifier import VerifierInfo, load_verifier_info
from eaglenest.artifacts.vocab import write_vocab
from eaglenest.core.atomic import atomic_directory, atomic_write_json
from eaglenest.core.errors import EaglenestError, InputFileError
from eaglenest.core.params import HiddenStateStorage
from eaglenest.core.stage import HiddenStatesInput, Stage, path_arg
from eaglenest.stages.convert.params import ConvertParams, ConvertStageParams

log = logging.getLogger(__name__)

SHOW_BAD = 5


def check_hidden_state_file(path: Path, input_ids: list[int], verifier: VerifierInfo, dtype: str) -> str | None:
    """Everything wrong with one row's file (header, tokens, finiteness, then its checksum), or None."""
    try:
        read_hidden_state_file(path, input_ids, verifier, dtype)
    except HiddenStateFileError as err:
        return err.problem
    return verify_checksum(path)  # a second read of a row's file: page-cached


def check_shard(
    stored: StoredHiddenStates, spec: ShardSpec, input_ids: list[list[int]], verifier: VerifierInfo, dtype: str
) -> dict[int, str]:
    """``{row: problem}`` for the rows of one shard: every row when the header or row index is bad, else each
    row read alone (its token ids and finiteness; its digest taken for the shard's checksum), so memory is a row's;
    every row without a problem of its own when the shard fails its checksum."""
    from safetensors import SafetensorError, safe_open

    path = spec.path(stored.folder)
    problem = check_shard_header(
        path,
        rows=spec.rows,
        lengths=[len(ids) for ids in input_ids],
        num_slots=len(verifier.layer_ids),
        hidden_size=verifier.hidden_size,
        dtype=dtype,
        config=None,
        rows_per_shard=stored.rows_per_shard,
    )
    if problem is not None:
        return dict.fromkeys(spec.rows, problem)
    problems, digests = {}, []
    try:
        with safe_open(str(path), framework="pt") as handle:
            index_tensor = handle.get_tensor(ROW_INDEX_KEY)  # [rows, 3]: row, first token, length
            index = {int(row): (int(first), int(length)) for row, first, length in index_tensor.tolist()}
            for row in spec.rows:
                stored_row = read_shard_row(handle, *index[row])
                digests.append(row_digest(stored_row))
                try:
                    checked_hidden_states(path, stored_row, input_ids[row])
                except HiddenStateFileError as err:
                    problems[row] = err.problem
            mismatch = checksum_problem(handle.metadata() or {}, digests, handle.get_tensor(TOKENS_KEY), index_tensor)
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:
        return dict.fromkeys(spec.rows, f"unreadable: {err}")
    if mismatch is not None:
        return {row: problems.get(row, mismatch) for row in spec.rows}
    return problems


def validate_hidden_states(
    input_ids: list[list[int]], stored: StoredHiddenStates, verifier: VerifierInfo, dtype: str, workers: int
) -> dict[int, str]:
    """``{row: problem}`` for every prepared row whose file (or shard) is bad or missing, or whose own data is."""
    from eaglenest.core.progress import progress

    def check(spec: ShardSpec) -> dict[int, str]:
        if not stored.row_files:
            return check_shard(stored, spec, input_ids, verifier, dtype)
        problem = check_hidden_state_file(spec.path(stored.folder), input_ids[spec.number], verifier, dtype)
        return {} if problem is None else {spec.number: problem}

    problems: dict[int, str] = {}
    unit = "file" if stored.row_files else "shard"
    with ThreadPoolExecutor(max_workers=workers) as pool:  # safetensors and torch release the GIL
        for found in progress(len(stored.plan), "validating", unit, iterable=pool.map(check, stored.plan)):
            problems.update(found)
    return problems


def loss_token_frequencies(input_ids: list[list[int]], loss_mask: list[list[int]], rows: list[int]) -> dict[int, int]:
    """``{token_id: count}`` of the loss-masked tokens of ``rows``."""
    counts = np.zeros(0, dtype=np.int64)
    for row in rows:
        ids = np.asarray(input_ids[row], dtype=np.int64)[np.asarray(loss_mask[row], dtype=bool)]
        if ids.size:
            row_counts = np.bincount(ids)
            if row_counts.size > counts.size:
                counts = np.pad(counts, (0, row_counts.size - counts.size))
            counts[: row_counts.size] += row_counts
    return {int(token): int(count) for token, count in enumerate(counts) if count}


def coverage(frequencies: dict[int, int], in_draft: torch.Tensor) -> float | None:
    """Fraction of the counted tokens that the draft vocabulary contains (None when nothing was counted)."""
    total = sum(frequencies.values())
    if total == 0:
        return None
    covered = sum(count for token, count in frequencies.items() if token < in_draft.numel() and in_draft[token])
    return round(covered / total, 6)


def _bad_files_message(problems: dict[int, str], stored: StoredHiddenStates, total: int) -> str:
    what = "hidden-state files" if stored.row_files else "rows' hidden states"
    lines = [f"{len(problems)} of {total} {what} are bad (first {min(SHOW_BAD, len(problems))}):"]
    lines += [f"  {stored.location(row)}: {problems[row]}" for row in sorted(problems)[:SHOW_BAD]]
    lines.append("  fix: delete them and run `dvc repro` (extract recomputes them), or set convert.on_bad: skip")
    return "\n".join(lines)


@dataclass(frozen=True)
class UsableRows:
    """The first phase's result: the rows whose hidden states validated, split as prepare split them.

    Attributes:
        verifier: The verifier stage's record.
        input_ids: Token ids of every prepared row.
        loss_mask: Loss mask of every prepared row.
        train: Usable train rows.
        val: Usable validation rows.
        problems: ``{row: problem}`` of the rows left out (``convert.on_bad: skip``).
        stored: The hidden-state folder (None for ``extract.store: online``).
    """

    verifier: VerifierInfo
    input_ids: list[list[int]]
    loss_mask: list[list[int]]
    train: list[int]
    val: list[int]
    problems: dict[int, str]
    stored: StoredHiddenStates | None = None

    @property
    def usable(self) -> list[int]:
        return sorted(self.train + self.val)


def find_usable_rows(
    params: ConvertParams, extract: HiddenStateStorage, verifier_dir: Path, prepared_dir: Path, hs_dir: Path
) -> UsableRows:
    """Phase 1: every hidden-state file validated against its prepared row (``extract.store: online``: the
    manifest against the rows, every row usable; the train stage checks each row it computes)."""
    verifier, _ = load_verifier_info(verifier_dir)
    if params.draft_vocab_size is not None and params.draft_vocab_size > verifier.vocab_size:
        raise EaglenestError(
            f"convert.draft_vocab_size = {params.draft_vocab_size} exceeds the verifier's vocabulary of "
            f"{verifier.vocab_size}; use null for the full vocabulary"
        )
    table = load_table(prepared_dir)
    input_ids: list[list[int]] = table.column("input_ids").to_pylist()
    loss_mask: list[list[int]] = table.column("loss_mask").to_pylist()
    split = load_split(prepared_dir)
    if not hs_dir.is_dir():
        raise InputFileError(f"{hs_dir}: no hidden-state folder; run `dvc repro extract` first")

    stored = None
    if extract.store != "files":  # online, stream: a manifest, nothing stored
        read_online_manifest(hs_dir, verifier, input_ids)
        problems: dict[int, str] = {}
    else:
        if (hs_dir / MANIFEST_FILE).is_file():
            raise InputFileError(
                f"{hs_dir / MANIFEST_FILE}: an extraction that stored nothing, but extract.store is files; run `dvc "
                "repro extract`"
            )
        stored = open_stored(hs_dir, len(input_ids))  # a folder of two layouts: one line, not a bad row each
        problems = validate_hidden_states(input_ids, stored, verifier, extract.dtype, params.workers)
    if problems and params.on_bad == "fail":
        raise InputFileError(_bad_files_message(problems, stored, len(input_ids)))
    for row in sorted(problems)[:SHOW_BAD]:
        log.warning("excluding row %d: %s: %s", row, stored.location(row), problems[row])
    usable = [row for row in range(len(input_ids)) if row not in problems]
    train = [row for row in usable if row < split["train_rows"]]
    val = [row for row in usable if row >= split["train_rows"]]
    if not train or not val:
        raise EaglenestError(
            f"after excluding {len(problems)} bad rows, {len(train)} train and {len(val)} validation rows are left; "
            "both need at least one"
        )
    return UsableRows(verifier, input_ids, loss_mask, train, val, problems, stored)


def build_vocabulary(params: ConvertParams, rows: UsableRows, out_dir: Path) -> dict[str, Any]:
    """Phase 2: speculators' draft vocabulary from the train split's loss tokens, written with the usable rows
    (:mod:`eaglenest.artifacts.vocab`); returns the ``vocab.json`` record."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    verifier = rows.verifier
    train_freq = loss_token_frequencies(rows.input_ids, rows.loss_mask, rows.train)
    val_freq = loss_token_frequencies(rows.input_ids, rows.loss_mask, rows.val)
    draft_vocab_size = params.draft_vocab_size or verifier.vocab_size
    if params.draft_vocab_size is None:
        mapping = None
        in_draft = torch.ones(verifier.vocab_size, dtype=torch.bool)
    else:
        mapping = build_vocab_mappings_from_distribution(train_freq, draft_vocab_size, verifier.vocab_size)
        in_draft = mapping[1]  # t2d
    record = {
        "draft_vocab_size": draft_vocab_size,
        "verifier_vocab_size": verifier.vocab_size,
        "full_vocabulary": params.draft_vocab_size is None,
        "distinct_train_tokens": len(train_freq),
        "vocab_coverage_train": coverage(train_freq, in_draft),
        "vocab_coverage_val": coverage(val_freq, in_draft),
    }
    problems = rows.problems
    with atomic_directory(out_dir) as tmp:
        write_vocab(
            tmp,
            train_freq,
            mapping,
            record,
            {
                "train": rows.train,
                "val": rows.val,
                "excluded": sorted(problems),
                "problems": {str(row): problems[row] for row in sorted(problems)},
            },
        )
    return record


def write_data_metrics(
    rows: UsableRows, vocab: dict[str, Any], extract: HiddenStateStorage, metrics_path: Path
) -> dict[str, Any]:
    """Phase 3: what the training set holds (``metrics/data.json``); returns the metrics."""
    usable, problems = rows.usable, rows.problems
    tokens = sum(len(rows.input_ids[row]) for row in usable)
    size = 0 if rows.stored is None else rows.stored.size_of(usable)  # online: nothing stored
    metrics = {
        "store": extract.store,
        "samples": len(usable),
        "train_samples": len(rows.train),
        "val_samples": len(rows.val),
        "tokens": tokens,
        "loss_tokens": sum(sum(rows.loss_mask[row]) for row in usable),
        "bytes": size,
        "bytes_per_token": round(size / tokens, 1),
        "draft_vocab_size": vocab["draft_vocab_size"],
        "vocab_coverage_train": vocab["vocab_coverage_train"],
        "vocab_coverage_val": vocab["vocab_coverage_val"],
        "excluded": len(problems),
        "excluded_rows": sorted(problems),
    }
    atomic_write_json(metrics_path, metrics)
    log.info(
        "%d rows valid (%d excluded); draft vocabulary %d covers %.1f%% of train, %.1f%% of val loss tokens",
        len(usable),
        len(problems),
        vocab["draft_vocab_size"],
        100 * (vocab["vocab_coverage_train"] or 0),
        100 * (vocab["vocab_coverage_val"] or 0),
    )
    return metrics


def convert(
    params: ConvertParams,
    extract: HiddenStateStorage,
    verifier_dir: Path,
    prepared_dir: Path,
    hs_dir: Path,
    out_dir: Path,
    metrics_path: Path,
) -> dict[str, Any]:
    """The convert stage's work: validate, build the vocabulary, count; returns the metrics it writes.

    Args:
        params: The convert params.
        extract: The extract params the hidden states were written with (``dtype``, ``store``).
        verifier_dir: The verifier stage's output folder.
        prepared_dir: The prepare stage's dataset folder.
        hs_dir: The extract stage's folder.
        out_dir: The vocabulary folder (``data/vocab``).
        metrics_path: ``metrics/data.json``.
    """
    rows = find_usable_rows(params, extract, verifier_dir, prepared_dir, hs_dir)
    vocab = build_vocabulary(params, rows, out_dir)
    return write_data_metrics(rows, vocab, extract, metrics_path)


@dataclass(frozen=True)
class ConvertPaths(HiddenStatesInput):
    """Where dvc.yaml puts the convert stage's inputs and outputs."""

    out: Path = path_arg("vocabulary folder (data/vocab)")
    metrics: Path = path_arg("metrics JSON (metrics/data.json)")


def run(params: ConvertStageParams, paths: ConvertPaths) -> dict[str, Any]:
    """The convert stage: reads ``extract.dtype`` and ``extract.store``, which its input was written with."""
    return convert(
        params.convert, params.extract, paths.verifier, paths.prepared, paths.hidden_states, paths.out, paths.metrics
    )


STAGE = Stage(
    "convert", "Validate every hidden-state file and build the draft vocabulary.", ConvertStageParams, ConvertPaths, run
)
