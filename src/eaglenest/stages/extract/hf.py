"""The ``hf`` extract back end: transformers on CPU or one GPU, the reference implementation.

Runs only the verifier's decoder over length-sorted batches of a task's rows, with :mod:`eaglenest.core.decoder`'s
hooks on the aux layers and on the final norm's input (the same code online training runs). Batches are planned
within a task (a shard), so the local executor and every Ray actor batch a shard's rows the same way.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping

import torch

from eaglenest.core.decoder import capture_residual_stream, hidden_states_of_rows, load_decoder
from eaglenest.core.device import pick_device
from eaglenest.stages.extract.job import EngineSettings, RowWriter

log = logging.getLogger(__name__)


def length_sorted_batches(
    rows: list[int], lengths: Mapping[int, int] | list[int], batch_tokens: int
) -> list[list[int]]:
    """Rows grouped longest first so that ``len(batch) * longest <= batch_tokens`` (padding stays small).

    A row longer than ``batch_tokens`` gets a batch of its own.
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


class HfEngine:
    """The verifier's decoder, loaded once, with its residual stream hooked."""

    name = "hf"

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.device = pick_device(settings.params.device, "extract.device")
        self.model = load_decoder(settings.model_dir, settings.verifier.trust_remote_code, self.device)
        self.pad_id = getattr(self.model.config, "pad_token_id", None) or 0
        self._hooks = contextlib.ExitStack()
        self.captured = self._hooks.enter_context(capture_residual_stream(self.model, settings.verifier.layer_ids))
        log.info("hf back end on %s", self.device)

    def compute(self, rows: list[int], input_ids: dict[int, list[int]], write: RowWriter) -> None:
        """Every row of ``rows`` through the decoder, in length-sorted batches of at most ``extract.batch_tokens``."""
        params = self.settings.params
        lengths = {row: len(ids) for row, ids in input_ids.items()}
        with torch.inference_mode():
            for batch in length_sorted_batches(rows, lengths, params.batch_tokens):
                hidden = hidden_states_of_rows(
                    self.model,
                    self.captured,
                    self.settings.verifier.layer_ids,
                    [input_ids[row] for row in batch],
                    self.pad_id,
                    self.device,
                    f"lower extract.batch_tokens (now {params.batch_tokens})",
                )
                for i, row in enumerate(batch):
                    write(row, hidden[i, : lengths[row]])  # [seq, n_aux + 1, hidden]

    def close(self) -> None:
        self._hooks.close()
