"""The convert stage: validate every hidden-state file, build the draft vocabulary, count the data.

Validation reads every ``hs_{i}.safetensors`` in full: header (keys, dtypes, shape ``[seq, n_aux + 1,
hidden]`` against the verifier stage's record, length on disk), ``token_ids`` equal to the prepared
``input_ids``, and every value finite. With ``convert.on_bad: fail`` any bad file stops the stage with the
first offenders listed; with ``skip`` those rows are excluded from training and listed in
``data/vocab/rows.json`` and ``metrics/data.json``.

The draft vocabulary is speculators' own construction (``build_vocab_mappings_from_distribution``): the
most frequent loss-masked tokens of the *train* split, ties by id, filled deterministically with the
lowest unused ids when fewer distinct tokens were seen. Files use speculators' names, so ``speculators
train --data-path`` finds them: ``d2t-{V}.npy`` (int64 ``[V]``, ``target = i + d2t[i]``), ``t2d-{V}.npy``
(bool ``[verifier_vocab]``) and ``token_freq.pt`` (``{token_id: count}``).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eaglenest.artifacts.hidden_states import MANIFEST_FILE, hs_path, read_hidden_state_file, read_online_manifest
from eaglenest.artifacts.prepared import load_split
from eaglenest.artifacts.verifier import VerifierInfo, load_verifier_info
from eaglenest.artifacts.vocab import ROWS_FILE, VOCAB_FILE
from eaglenest.core.atomic import atomic_directory, atomic_write_json
from eaglenest.core.errors import EaglenestError, InputFileError
from eaglenest.core.params import ConvertParams

log = logging.getLogger(__name__)

SHOW_BAD = 5


def check_hidden_state_file(path: Path, input_ids: list[int], verifier: VerifierInfo, dtype: str) -> str | None:
    """Everything wrong with one row's file (header, tokens, finiteness), or None."""
    return read_hidden_state_file(path, input_ids, verifier, dtype)[0]


def validate_hidden_states(input_ids: list[list[int]], hs_dir: Path, verifier: VerifierInfo, dtype: str,
                           workers: int) -> dict[int, str]:
    """``{row: problem}`` for every prepared row whose hidden-state file is bad or missing."""
    from tqdm import tqdm

    def check(row: int) -> tuple[int, str | None]:
        return row, check_hidden_state_file(hs_path(hs_dir, row), input_ids[row], verifier, dtype)

    problems: dict[int, str] = {}
    with ThreadPoolExecutor(max_workers=workers) as pool:  # safetensors and torch release the GIL
        for row, problem in tqdm(pool.map(check, range(len(input_ids))), total=len(input_ids),
                                 desc="convert: validating", unit="file"):
            if problem is not None:
                problems[row] = problem
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


def _bad_files_message(problems: dict[int, str], hs_dir: Path, total: int) -> str:
    lines = [f"{len(problems)} of {total} hidden-state files are bad (first {min(SHOW_BAD, len(problems))}):"]
    lines += [f"  {hs_path(hs_dir, row)}: {problems[row]}" for row in sorted(problems)[:SHOW_BAD]]
    lines.append("  fix: delete them and run `dvc repro` (extract recomputes them), or set convert.on_bad: skip")
    return "\n".join(lines)


def convert(params: ConvertParams, dtype: str, verifier_dir: Path, prepared_dir: Path, hs_dir: Path,
            out_dir: Path, metrics_path: Path, store: str = "files") -> dict[str, Any]:
    """The convert stage; returns the metrics it writes.

    With ``extract.store: online`` there are no files to validate: the manifest is checked against the prepared
    rows and the verifier instead, every row is usable, and the train stage checks each row it computes.
    """
    from datasets import load_from_disk
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    verifier, _ = load_verifier_info(verifier_dir)
    if params.draft_vocab_size is not None and params.draft_vocab_size > verifier.vocab_size:
        raise EaglenestError(
            f"convert.draft_vocab_size = {params.draft_vocab_size} exceeds the verifier's vocabulary of "
            f"{verifier.vocab_size}; use null for the full vocabulary"
        )
    table = load_from_disk(str(prepared_dir)).data
    input_ids: list[list[int]] = table.column("input_ids").to_pylist()
    loss_mask: list[list[int]] = table.column("loss_mask").to_pylist()
    split = load_split(prepared_dir)
    if not hs_dir.is_dir():
        raise InputFileError(f"{hs_dir}: no hidden-state folder; run `dvc repro extract` first")

    if store == "online":
        read_online_manifest(hs_dir, verifier, input_ids)
        problems: dict[int, str] = {}
    else:
        if (hs_dir / MANIFEST_FILE).is_file():
            raise InputFileError(
                f"{hs_dir / MANIFEST_FILE}: an online extraction, but extract.store is files; run `dvc repro extract`"
            )
        problems = validate_hidden_states(input_ids, hs_dir, verifier, dtype, params.workers)
    if problems and params.on_bad == "fail":
        raise InputFileError(_bad_files_message(problems, hs_dir, len(input_ids)))
    for row in sorted(problems)[:SHOW_BAD]:
        log.warning("excluding row %d: %s: %s", row, hs_path(hs_dir, row), problems[row])
    usable = [row for row in range(len(input_ids)) if row not in problems]
    train = [row for row in usable if row < split["train_rows"]]
    val = [row for row in usable if row >= split["train_rows"]]
    if not train or not val:
        raise EaglenestError(
            f"after excluding {len(problems)} bad rows, {len(train)} train and {len(val)} validation rows are left; "
            "both need at least one"
        )

    train_freq = loss_token_frequencies(input_ids, loss_mask, train)
    val_freq = loss_token_frequencies(input_ids, loss_mask, val)
    draft_vocab_size = params.draft_vocab_size or verifier.vocab_size
    with atomic_directory(out_dir) as tmp:
        torch.save(train_freq, tmp / "token_freq.pt")
        if params.draft_vocab_size is None:
            in_draft = torch.ones(verifier.vocab_size, dtype=torch.bool)
        else:
            d2t, t2d = build_vocab_mappings_from_distribution(train_freq, draft_vocab_size, verifier.vocab_size)
            np.save(tmp / f"d2t-{draft_vocab_size}.npy", d2t.numpy())
            np.save(tmp / f"t2d-{draft_vocab_size}.npy", t2d.numpy())
            in_draft = t2d
        vocab = {
            "draft_vocab_size": draft_vocab_size,
            "verifier_vocab_size": verifier.vocab_size,
            "full_vocabulary": params.draft_vocab_size is None,
            "distinct_train_tokens": len(train_freq),
            "vocab_coverage_train": coverage(train_freq, in_draft),
            "vocab_coverage_val": coverage(val_freq, in_draft),
        }
        atomic_write_json(tmp / VOCAB_FILE, vocab)
        atomic_write_json(tmp / ROWS_FILE, {
            "train": train, "val": val, "excluded": sorted(problems),
            "problems": {str(row): problems[row] for row in sorted(problems)},
        })

    tokens = sum(len(input_ids[row]) for row in usable)
    size = 0 if store == "online" else sum(hs_path(hs_dir, row).stat().st_size for row in usable)
    metrics = {
        "store": store,
        "samples": len(usable),
        "train_samples": len(train),
        "val_samples": len(val),
        "tokens": tokens,
        "loss_tokens": sum(sum(loss_mask[row]) for row in usable),
        "bytes": size,
        "bytes_per_token": round(size / tokens, 1),
        "draft_vocab_size": draft_vocab_size,
        "vocab_coverage_train": vocab["vocab_coverage_train"],
        "vocab_coverage_val": vocab["vocab_coverage_val"],
        "excluded": len(problems),
        "excluded_rows": sorted(problems),
    }
    atomic_write_json(metrics_path, metrics)
    log.info("%d rows valid (%d excluded); draft vocabulary %d covers %.1f%% of train, %.1f%% of val loss tokens",
             len(usable), len(problems), draft_vocab_size, 100 * (vocab["vocab_coverage_train"] or 0),
             100 * (vocab["vocab_coverage_val"] or 0))
    return metrics


