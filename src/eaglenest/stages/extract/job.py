"""The extract back ends' contract: what a back end is given (:class:`ExtractionJob`) and how it hands back
each row (:meth:`ExtractionJob.write`). Back ends import this module, never the stage that dispatches to them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eaglenest.artifacts.hidden_states import encode_hidden_states, hs_path, write_hidden_states
from eaglenest.artifacts.verifier import VerifierInfo
from eaglenest.core.errors import EaglenestError
from eaglenest.core.params import ExtractParams


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
        stored = encode_hidden_states(hidden_states.to(device="cpu"), self.params.dtype)
        self.bytes_written += write_hidden_states(hs_path(self.out_dir, row), stored, tokens, self.metadata)
        self.on_row(row, len(tokens))


# A back end computes every row of job.todo and hands each to job.write.
Backend = Callable[[ExtractionJob], None]
