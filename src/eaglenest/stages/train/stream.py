"""``extract.store: stream``, the trainer's side: speculators' hidden-state transfer fed by a pool of engines.

The trainer's batches are a pure function of the params (:func:`planned_batches`), so the whole plan is known when
training starts: the engines compute it ahead, at most ``extract.stream_buffer`` batches, and
:class:`StreamTransfer` takes each batch from the stream as the train loop asks for it, refusing one that is not
the plan's next. A resumed run plans from the step it resumes at.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from eaglenest.artifacts.hidden_states.stream import HiddenStateStream
from eaglenest.stages.train.online import ComputedTransfer


class StreamTransfer(ComputedTransfer):
    """Rows computed by the engines of a :class:`HiddenStateStream`, one planned batch at a time."""

    def __init__(self, stream: HiddenStateStream, dequantize_dtype: torch.dtype) -> None:
        super().__init__(dequantize_dtype)
        self.stream = stream

    def compute(self, rows: list[int]) -> None:
        """Takes the plan's next batch, which must be ``rows``."""
        if all(row in self._ready for row in rows):
            return
        self._ready.update(self.stream.next_batch(rows))

    def close(self) -> None:
        """Stops the engines."""
        self.stream.close()
        super().close()


def planned_batches(
    train_sequences: Iterator[list[int]],
    sequences_per_step: int,
    mine: range,
    steps: range,
    val_batches: list[list[int]] | None,
    validates_after: Callable[[int], bool],
) -> Iterator[list[int]]:
    """The batches one training process asks for, in its order: the untrained draft's validation on a fresh start,
    then per step its sequences of the global batch, and the validation batches after each step that validates.

    Args:
        train_sequences: The global batches' sequences from the first step on (the same stream on every process).
        sequences_per_step: Sequences of one global batch (``train.nproc``).
        mine: This process's places in a global batch.
        steps: The steps this run trains.
        val_batches: The validation batches where this process validates (rank 0), else None.
        validates_after: Whether the process validates after a step (its number, counted from 1).
    """
    if val_batches is not None and steps.start == 0:
        yield from val_batches
    for step in steps:
        sequences = [next(train_sequences) for _ in range(sequences_per_step)]
        for index in mine:
            yield sequences[index]
        if val_batches is not None and validates_after(step + 1):
            yield from val_batches
