"""The hidden-state engines' contract: what an engine is built from (:class:`EngineSettings`), what it does
(:class:`Engine`: computes rows, handing each to a :data:`RowWriter`), the check every computed row passes
(:func:`checked_row`) and the hf back end's batch plan (:func:`length_sorted_batches`). Back ends import this module,
never the registry that builds them; the extract stage's tasks and the stream's tasks both run engines through it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from eaglenest.artifacts.hidden_states.extract_params import ExtractParams
from eaglenest.artifacts.hidden_states.format import encode_hidden_states
from eaglenest.artifacts.verifier import VerifierInfo
from eaglenest.core.errors import EaglenestError

# (row, its [seq, n_aux + 1, hidden] hidden states) -> stored in the row's file
RowWriter = Callable[[int, torch.Tensor], None]
# A row's tensors as stored (encode_hidden_states): what a RowTask returns for each of its rows
StoredRow = dict[str, torch.Tensor]


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


def length_sorted_batches(
    rows: list[int], lengths: Mapping[int, int] | list[int], batch_tokens: int
) -> list[list[int]]:
    """Rows grouped longest first so that ``len(batch) * longest <= batch_tokens`` (padding stays small).

    A row longer than ``batch_tokens`` gets a batch of its own; so does every row with ``batch_tokens`` 0. The packing
    is greedy in the sorted order, so the rows of consecutive whole batches are packed again into the very same
    batches (the extract stage cuts its tasks on it).
    """
    batches: list[list[int]] = []
    current: list[int] = []
    for row in sorted(rows, key=lambda r: (-lengths[r], r)):
        longest = lengths[current[0]] if current else lengths[row]
        if current and (len(current) + 1) * longest > batch_tokens:
            batches.append(current)
            current = []
        current.append(row)
    if current:
        batches.append(current)
    return batches


def checked_row(row: int, hidden: torch.Tensor, expected: tuple[int, ...], backend: str) -> torch.Tensor:
    """``hidden`` ``[seq, n_aux + 1, hidden]`` on the CPU, refused when its shape is not ``expected`` (the row's) or a
    value is not finite (the verifier overflowed on this row: a file of it would fail convert, or poison training)."""
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


def compute_stored_rows(
    engine: Engine,
    rows: Sequence[int],
    input_ids: Mapping[int, Sequence[int]],
    row_shape: tuple[int, ...],
    dtype: str,
    label: str,
) -> dict[int, StoredRow]:
    """``rows`` computed by ``engine``, each checked (:func:`checked_row`: ``[seq, *row_shape]``, finite), encoded as
    stored in ``dtype`` and copied out of its batch (a view would carry the whole batch's storage wherever the row
    travels).

    Raises:
        EaglenestError: a row came back with the wrong shape, a non-finite value, twice, or not at all (``label``
            names the task).
    """
    backend = getattr(engine, "name", "extract")
    stored: dict[int, StoredRow] = {}

    def write(row: int, hidden: torch.Tensor) -> None:
        if row not in input_ids or row in stored:
            raise EaglenestError(f"{label}: the {backend} back end returned row {row} twice, or a row not of this task")
        row_tensors = encode_hidden_states(checked_row(row, hidden, (len(input_ids[row]), *row_shape), backend), dtype)
        stored[row] = {name: tensor.clone() for name, tensor in row_tensors.items()}

    engine.compute(list(rows), {row: list(input_ids[row]) for row in rows}, write)
    missing = [row for row in rows if row not in stored]
    if missing:
        raise EaglenestError(f"{label}: the {backend} back end never returned rows {missing}")
    return stored
