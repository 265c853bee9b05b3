"""Training data: speculators' ArrowDataset and CollateFn over the hidden-state files, packed into batches.

speculators' ``CollateFn`` packs rows into one ``[1, total_seq_len]`` sequence per step, after
``shift_batch``: position t pairs the verifier's aux hidden states g_t with the *next* token x_{t+1}, and
the target is the verifier's distribution at t+1, so the draft predicts x_{t+2}, as it will when serving
(EAGLE-3 and P-EAGLE; DFlash reads the rows unshifted and aligns its blocks itself). The order is a pure
function of (seed, epoch), so a resumed run sees exactly the batches the uninterrupted one would have.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eaglenest.artifacts.hidden_states.online import MANIFEST_FILE, read_online_manifest
from eaglenest.artifacts.prepared import load_table
from eaglenest.artifacts.verifier import VerifierInfo
from eaglenest.artifacts.vocab import load_rows
from eaglenest.core.errors import EaglenestError
from eaglenest.core.params import ClusterParams
from eaglenest.stages.train.model import ALGORITHMS
from eaglenest.stages.train.online import ComputedTransfer, OnlineTransfer
from eaglenest.stages.train.params import TrainParams


@dataclass(frozen=True)
class TrainingData:
    """The rows to train and validate on, and how to turn a batch of row indices into model inputs.

    Attributes:
        dataset: speculators' ArrowDataset over every prepared row (row i is file ``hs_i``).
        collate: speculators' CollateFn: a list of rows -> one packed ``[1, total_seq_len]`` batch.
        rows: ``{"train": [...], "val": [...]}`` from the convert stage (bad rows already left out).
        lengths: Tokens of every prepared row.
        online: Where each batch's hidden states are computed (``extract.store: online``: the verifier in this
            process; ``stream``: a pool of engines), else None (stored files).
        loss_on_every_token: ``train.loss_tokens: all``: training batches carry the loss at every position
            (``every_token_mask``).
        ttt_steps: ``train.ttt_steps``: how far speculators shifts targets, so how many positions stay unscored.
    """

    dataset: Any
    collate: Any
    rows: dict[str, list[int]]
    lengths: list[int]
    online: ComputedTransfer | None
    loss_on_every_token: bool
    ttt_steps: int

    def batch(self, rows: list[int], device: torch.device, *, training: bool = False) -> dict[str, Any]:
        """The packed model inputs of ``rows`` on ``device``; validation batches keep the replies' loss mask."""
        if self.online is not None:  # the whole batch at once: one forward, or the stream's next batch
            self.online.compute(rows)
        items = [self.dataset[i] for i in rows]
        if training and self.loss_on_every_token:
            items = [{**item, "loss_mask": every_token_mask(item["loss_mask"], self.ttt_steps)} for item in items]
        return to_device(self.collate(items), device)


def every_token_mask(loss_mask: torch.Tensor, ttt_steps: int) -> torch.Tensor:
    """``train.loss_tokens: all``: the loss on every position of a row but its first ``ttt_steps``.

    speculators aligns TTT step k's targets by shifting the packed sequence k positions, so a chain that starts
    near the end of one row is scored against the first k targets of the next row. A reply mask is 0 there
    (every row opens with its prompt); an all-ones mask must be too, or rows would be trained on each other.
    Position 0 is dropped by ``shift_batch``, so zeroing [0, ttt_steps) zeroes the first ttt_steps - 1 positions.
    A DFlash block anchored near a row's end reaches at most ttt_steps positions into the next row: zeroed too.
    """
    mask = torch.ones_like(loss_mask)  # [seq_len]
    mask[:ttt_steps] = 0
    return mask


def load_training_data(
    params: TrainParams,
    verifier: VerifierInfo,
    prepared: Path,
    hidden_states: Path,
    vocab: Path,
    hs_dtype: torch.dtype,
    model_dir: Path | None = None,
    device: torch.device | None = None,
    cluster: ClusterParams | None = None,
) -> TrainingData:
    """Opens the data; refuses a prepared row longer than ``train.total_seq_len`` (one line, with the fix).

    Args:
        params: The train params.
        verifier: The verifier stage's record (hidden size, aux layers).
        prepared: The prepare stage's dataset folder.
        hidden_states: The extract stage's folder: ``hs_{i}.safetensors`` files, or the manifest of
            ``extract.store: online``, whose rows are then computed from the verifier as they are batched.
        vocab: The convert stage's folder (its ``rows.json``).
        hs_dtype: The dtype hidden states are loaded in (bf16 on GPU, fp32 on CPU).
        model_dir: The verifier's weights (online and stream only).
        device: Where the verifier runs (online only): the training device.
        cluster: Where a stream's engines run (stream only; None: engine processes on this machine). The stream
            starts when the train stage knows its plan (:meth:`StreamTransfer.stream`'s ``start``).
    """
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn

    table = load_table(prepared)
    lengths = table.column("seq_len").to_pylist()
    rows = checked_rows(params, vocab, lengths)
    online: ComputedTransfer | None = None
    if (hidden_states / MANIFEST_FILE).is_file():
        if model_dir is None or device is None:
            raise EaglenestError(f"{hidden_states} is an online extraction: its hidden states need the verifier")
        input_ids = table.column("input_ids").to_pylist()
        manifest = read_online_manifest(hidden_states, verifier, input_ids)
        if manifest["store"] == "stream":
            from eaglenest.artifacts.hidden_states.stream import HiddenStateStream
            from eaglenest.stages.train.stream import StreamTransfer

            stream = HiddenStateStream(manifest, verifier, model_dir, input_ids, cluster or ClusterParams())
            online = StreamTransfer(stream, hs_dtype)
        else:
            online = OnlineTransfer(model_dir, verifier, input_ids, str(manifest["dtype"]), device, hs_dtype)
        transfer: Any = online
    else:
        transfer = stored_transfer(hidden_states, len(lengths), hs_dtype)
    dataset = ArrowDataset(
        max_len=params.total_seq_len,
        datapath=prepared,
        transfer=transfer,
        on_missing="raise",
        hidden_states_dtype=hs_dtype,
    )
    # EAGLE-3 and P-EAGLE pair the state at t with the token at t + 1 (shift_batch); DFlash reads rows unshifted.
    shift = shift_batch if ALGORITHMS.get(params.algorithm).shifts_rows else None
    collate = CollateFn(
        max_len=params.total_seq_len,
        hidden_size=verifier.hidden_size,
        num_target_layers=len(verifier.aux_layers),
        dtype=hs_dtype,
        preprocess=shift,
    )
    return TrainingData(
        dataset,
        collate,
        rows,
        lengths,
        online,
        loss_on_every_token=params.loss_tokens == "all",
        ttt_steps=params.ttt_steps,
    )


def checked_rows(params: TrainParams, vocab: Path, lengths: list[int]) -> dict[str, list[int]]:
    """The convert stage's train and validation rows; refuses one longer than ``train.total_seq_len`` (one line,
    with the fix). Cheap: the stage runs it before it starts several processes, so a bad value is said once.

    Args:
        params: The train params.
        vocab: The convert stage's folder (its ``rows.json``).
        lengths: Tokens of every prepared row (the prepared table's ``seq_len``).
    """
    rows = load_rows(vocab)
    too_long = [row for row in rows["train"] + rows["val"] if lengths[row] > params.total_seq_len]
    if too_long:
        raise EaglenestError(
            f"train.total_seq_len = {params.total_seq_len} is shorter than prepared row {too_long[0]} "
            f"({lengths[too_long[0]]} tokens; {len(too_long)} rows in all); raise it to at least "
            f"{max(lengths)} or lower prepare.max_len"
        )
    return rows


def stored_transfer(hidden_states: Path, num_rows: int, hs_dtype: torch.dtype) -> Any:
    """speculators' FP8Transfer, reading each row through the hidden-state store (row files, or a slice of the
    memory-mapped shard: a batch costs its rows' memory, never a whole shard's); rows stored in fp8 are dequantized
    as FP8Transfer does. The convert stage has validated every file against the prepared rows."""
    from hs_connectors import FP8Transfer

    from eaglenest.artifacts.hidden_states.reader import open_stored

    stored = open_stored(hidden_states, num_rows)

    class StoredTransfer(FP8Transfer):
        def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
            return self._dequantize(stored.read_row(file_idx))

    return StoredTransfer(hidden_states, dequantize_dtype=hs_dtype)


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Every tensor of a collated batch moved to ``device``."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def pack_batches(rows: list[int], lengths: list[int], total_seq_len: int, seed: int, epoch: int) -> list[list[int]]:
    """Rows shuffled by (seed, epoch) and packed greedily into batches of at most total_seq_len tokens."""
    order = list(rows)
    random.Random(f"{seed}:{epoch}").shuffle(order)
    batches: list[list[int]] = []
    current: list[int] = []
    used = 0
    for row in order:
        if current and used + lengths[row] > total_seq_len:
            batches.append(current)
            current, used = [], 0
        current.append(row)
        used += lengths[row]
    if current:
        batches.append(current)
    return batches


class PackedBatches:
    """Step -> batch of row indices, deterministic in (seed, epoch), so a resumed run continues exactly."""

    def __init__(self, rows: list[int], lengths: list[int], total_seq_len: int, seed: int) -> None:
        self.rows, self.lengths, self.total_seq_len, self.seed = rows, lengths, total_seq_len, seed

    def from_step(self, step: int) -> Iterator[list[int]]:
        epoch = 0
        while True:
            batches = pack_batches(self.rows, self.lengths, self.total_seq_len, self.seed, epoch)
            for batch in batches:
                if step > 0:
                    step -= 1
                    continue
                yield batch
            epoch += 1
