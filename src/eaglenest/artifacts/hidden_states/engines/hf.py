"""The ``hf`` extract back end: transformers on CPU or one GPU, the reference implementation.

Runs only the verifier's decoder over length-sorted batches of a task's rows, with :mod:`eaglenest.core.decoder`'s
hooks on the aux layers and on the final norm's input (the same code online training runs). Batches are planned
within a task, whose rows are whole batches of its shard's plan (:func:`~eaglenest.stages.extract.job.row_tasks`),
so the local executor and every Ray actor batch a shard's rows the same way, however it is cut into tasks.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from eaglenest.artifacts.hidden_states.engines.contract import EngineSettings, RowWriter, length_sorted_batches
from eaglenest.core.decoder import capture_residual_stream, hidden_states_of_rows, load_decoder
from eaglenest.core.device import pick_device

log = logging.getLogger(__name__)


def out_of_memory_fix(batch_tokens: int) -> str:
    """What to change when a batch does not fit: the batch, or (a row alone) the rows or the device."""
    if batch_tokens:
        return f"lower extract.batch_tokens (now {batch_tokens})"
    return "a row alone does not fit (extract.batch_tokens: 0): lower prepare.max_len, or use a larger device"


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
        """Every row of ``rows`` through the decoder: a forward each (``extract.batch_tokens`` 0), or in length-sorted
        batches of at most ``extract.batch_tokens`` tokens."""
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
                    out_of_memory_fix(params.batch_tokens),
                )
                for i, row in enumerate(batch):
                    write(row, hidden[i, : lengths[row]])  # [seq, n_aux + 1, hidden]

    def close(self) -> None:
        self._hooks.close()
