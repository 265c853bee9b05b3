"""The draft vocabulary and the usable rows: what the convert stage writes and the train stage reads.

Files use speculators' names, so ``speculators train --data-path`` finds them: ``d2t-{V}.npy`` (int64 ``[V]``,
``target = i + d2t[i]``), ``t2d-{V}.npy`` (bool ``[verifier_vocab]``) and ``token_freq.pt`` (``{token_id:
count}``); eaglenest adds ``vocab.json`` (sizes and coverage) and ``rows.json`` (the train and validation rows
whose hidden states validated, and the excluded ones with their problems).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eaglenest.core.atomic import atomic_write_json
from eaglenest.core.errors import EaglenestError, InputFileError
from eaglenest.core.json_file import read_json

ROWS_FILE = "rows.json"


VOCAB_FILE = "vocab.json"


def load_vocab(vocab_dir: Path) -> tuple[dict[str, Any], torch.Tensor | None, torch.Tensor | None]:
    """The convert stage's vocabulary record and its d2t/t2d tensors (None for the full vocabulary)."""
    try:
        vocab = json.loads((vocab_dir / VOCAB_FILE).read_text())
    except FileNotFoundError:
        raise EaglenestError(f"{vocab_dir / VOCAB_FILE} does not exist; run `dvc repro convert` first") from None
    if vocab["full_vocabulary"]:
        return vocab, None, None
    size = vocab["draft_vocab_size"]
    d2t = _load_npy(vocab_dir / f"d2t-{size}.npy", np.int64, (size,))
    t2d = _load_npy(vocab_dir / f"t2d-{size}.npy", np.bool_, (vocab["verifier_vocab_size"],))
    if int(t2d.sum()) != size or not torch.equal(torch.nonzero(t2d).flatten(), torch.arange(size) + d2t):
        raise InputFileError(f"{vocab_dir}: d2t-{size}.npy and t2d-{size}.npy disagree (target = i + d2t[i])")
    return vocab, d2t, t2d


def _load_npy(path: Path, dtype: Any, shape: tuple[int, ...]) -> torch.Tensor:
    """A vocabulary array, checked: never unpickled, expected dtype and shape."""
    try:
        array = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise InputFileError(f"{path}: missing; run `dvc repro convert`") from None
    except (OSError, ValueError, EOFError) as err:
        raise InputFileError(f"{path}: not a readable .npy file ({err})") from None
    if array.dtype != dtype or array.shape != shape:
        raise InputFileError(f"{path}: {array.dtype} {list(array.shape)}, expected {np.dtype(dtype)} {list(shape)}")
    return torch.from_numpy(array)


def write_vocab(
    directory: Path,
    token_freq: dict[int, int],
    mapping: tuple[torch.Tensor, torch.Tensor] | None,
    record: dict[str, Any],
    rows: dict[str, Any],
) -> None:
    """Writes the vocabulary folder's files into ``directory`` (the convert stage's temporary output folder).

    Args:
        directory: The folder.
        token_freq: ``{token_id: count}`` of the train split's loss tokens.
        mapping: speculators' ``(d2t, t2d)``, or None for the verifier's full vocabulary.
        record: ``vocab.json``: ``draft_vocab_size``, ``verifier_vocab_size``, ``full_vocabulary`` and coverage.
        rows: ``rows.json``: ``train``, ``val``, ``excluded`` and ``problems``.
    """
    directory = Path(directory)
    torch.save(token_freq, directory / "token_freq.pt")
    if mapping is not None:
        d2t, t2d = mapping
        size = record["draft_vocab_size"]
        np.save(directory / f"d2t-{size}.npy", d2t.numpy())
        np.save(directory / f"t2d-{size}.npy", t2d.numpy())
    atomic_write_json(directory / VOCAB_FILE, record)
    atomic_write_json(directory / ROWS_FILE, rows)


def load_rows(vocab_dir: Path) -> dict[str, list[int]]:
    """``{"train": [...], "val": [...]}``: the rows the convert stage found usable."""
    path = Path(vocab_dir) / ROWS_FILE
    rows = read_json(path, f"{path} does not exist; run `dvc repro convert` first", "run `dvc repro convert`")
    if not isinstance(rows, dict) or not all(isinstance(rows.get(k), list) for k in ("train", "val")):
        raise InputFileError(f"{path}: expected lists 'train' and 'val'; run `dvc repro convert`")
    return rows
