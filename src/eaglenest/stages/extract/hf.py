"""The ``hf`` extract back end: transformers on CPU or one GPU, the reference implementation.

Runs only the verifier's decoder over length-sorted batches, with :mod:`eaglenest.core.decoder`'s hooks on the
aux layers and on the final norm's input (the same code online training runs).
"""

from __future__ import annotations

import logging

import torch

from eaglenest.core.decoder import capture_residual_stream, hidden_states_of_rows, load_decoder
from eaglenest.core.device import pick_device
from eaglenest.stages.extract.job import ExtractionJob

log = logging.getLogger(__name__)


def length_sorted_batches(rows: list[int], lengths: list[int], batch_tokens: int) -> list[list[int]]:
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


def extract_with_transformers(job: ExtractionJob) -> None:
    """Computes every row in ``job.todo`` and hands each to ``job.write``."""
    device = pick_device(job.params.device, "extract.device")
    model = load_decoder(job.model_dir, job.verifier.trust_remote_code, device)
    pad_id = getattr(model.config, "pad_token_id", None) or 0
    lengths = [len(ids) for ids in job.input_ids]
    batches = length_sorted_batches(job.todo, lengths, job.params.batch_tokens)
    log.info("hf back end on %s: %d rows in %d batches of <= %d tokens", device, len(job.todo), len(batches),
             job.params.batch_tokens)
    with capture_residual_stream(model, job.verifier.layer_ids) as captured, torch.inference_mode():
        for batch in batches:
            hidden = hidden_states_of_rows(model, captured, job.verifier.layer_ids,
                                           [job.input_ids[row] for row in batch], pad_id, device,
                                           f"lower extract.batch_tokens (now {job.params.batch_tokens})")
            for i, row in enumerate(batch):
                job.write(row, hidden[i, : lengths[row]])
