"""``extract.store: online``: hidden states computed from the verifier as training consumes them, never stored.

speculators' data set asks its *transfer* for each row's hidden states (``get_cached(file_idx)``); for stored
files that is ``FP8Transfer``, which reads ``hs_{i}.safetensors``. :class:`OnlineTransfer` answers the same
question by running the verifier's decoder, with the extract stage's own hf code (hooks on the aux layers and
on the final norm's input), on the training device. Everything downstream (``ArrowDataset``, ``CollateFn``,
``shift_batch``, the draft) is unchanged.

Equivalence with stored training: each row's hidden states are rounded to the manifest's ``dtype`` (bf16, or
fp8 with per-token scales) exactly as the extract stage would store them, and dequantized by the function
speculators' ``FP8Transfer`` uses for stored files. What remains different is the batching of the verifier's
forward (the rows of one packed training batch here, length-sorted batches in extract), which moves fp32
results by rounding error only.
"""

from __future__ import annotations

import logging
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from hs_connectors.fp8_utils import dequantize_fp8_tensor
from hs_connectors.transfer import HiddenStatesTransfer

from eaglenest.artifacts.hidden_states.format import HIDDEN_KEY, SCALES_KEY, TOKENS_KEY, encode_hidden_states
from eaglenest.artifacts.verifier import VerifierInfo
from eaglenest.core.decoder import capture_residual_stream, decoder_dtype, hidden_states_of_rows, load_decoder
from eaglenest.core.errors import EaglenestError
from eaglenest.core.safetensors_header import read_header

log = logging.getLogger(__name__)

# Room left beside the verifier's weights for activations, the draft and its optimizer.
MEMORY_MARGIN = 1.25


def verifier_weight_bytes(model_dir: Path, device: torch.device) -> int:
    """The verifier's weights as the hf back end loads them on ``device`` (in :func:`decoder_dtype`), from the
    safetensors headers (nothing is read beyond them)."""
    numel = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        for _dtype, shape in read_header(path).tensors.values():
            count = 1
            for dim in shape:
                count *= dim
            numel += count
    return numel * decoder_dtype(device).itemsize


def available_memory(device: torch.device) -> int:
    """Bytes free on ``device`` now: the CUDA allocator's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_verifier_fits(model_dir: Path, device: torch.device) -> None:
    """Refuses, in one line, an online run whose verifier cannot sit in ``device``'s memory beside training."""
    need = verifier_weight_bytes(model_dir, device)
    free = available_memory(device)
    if need * MEMORY_MARGIN > free:
        raise EaglenestError(
            f"extract.store: online keeps the verifier ({model_dir}, {need / 2**30:.1f} GiB of weights as loaded "
            f"on {device.type}) in train.device's memory beside the draft, and {free / 2**30:.1f} GiB is free; "
            "use extract.store: files (extract once on a machine that holds it), or a device with more memory"
        )


class ComputedTransfer(HiddenStatesTransfer):
    """speculators' hidden-state transfer over rows computed ahead (by :meth:`compute`), never read from files.

    The train loop calls :meth:`compute` with a packed batch's rows before collating them; :meth:`get_cached`
    hands out one of them (computing it alone if it was not computed in advance), dequantized as speculators'
    ``FP8Transfer`` dequantizes a stored fp8 file.
    """

    def __init__(self, dequantize_dtype: torch.dtype) -> None:
        self._ready: dict[int, dict[str, torch.Tensor]] = {}
        self.dequantize_dtype = dequantize_dtype

    def compute(self, rows: list[int]) -> None:
        """Makes ``rows`` ready, each as the extract stage would store it."""
        raise NotImplementedError

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor]:
        """Row ``file_idx``'s ``{"hidden_states": [seq, slots, hidden], "token_ids": [seq]}``."""
        if file_idx not in self._ready:
            self.compute([file_idx])
        sample = self._ready.pop(file_idx)
        hidden = sample[HIDDEN_KEY]
        if SCALES_KEY in sample:  # what speculators' FP8Transfer does with a stored fp8 file
            hidden = dequantize_fp8_tensor(hidden, sample[SCALES_KEY], dtype=self.dequantize_dtype)
        return {HIDDEN_KEY: hidden, TOKENS_KEY: sample[TOKENS_KEY]}

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> None:
        """Part of speculators' transfer interface; never called (every row is "cached")."""
        return None

    def close(self) -> None:
        """Drops the rows computed and not used."""
        self._ready.clear()


class OnlineTransfer(ComputedTransfer):
    """Rows computed by the verifier's decoder in this process, on the training device (``extract.store:
    online``): one padded forward over each packed batch's rows."""

    def __init__(
        self,
        model_dir: Path,
        verifier: VerifierInfo,
        input_ids: list[list[int]],
        dtype: str,
        device: torch.device,
        dequantize_dtype: torch.dtype,
    ) -> None:
        super().__init__(dequantize_dtype)
        check_verifier_fits(model_dir, device)
        try:
            self.model = load_decoder(model_dir, verifier.trust_remote_code, device)
        except (torch.OutOfMemoryError, MemoryError):
            raise EaglenestError(
                f"out of memory loading the verifier on {device} for extract.store: online; use extract.store: files"
            ) from None
        self.verifier, self.input_ids, self.dtype, self.device = verifier, input_ids, dtype, device
        self.pad_id = getattr(self.model.config, "pad_token_id", None) or 0
        self._hooks = ExitStack()
        self._captured = self._hooks.enter_context(capture_residual_stream(self.model, verifier.layer_ids))

    def compute(self, rows: list[int]) -> None:
        """One decoder forward over ``rows``, each kept as the extract stage would store it."""
        rows = [row for row in rows if row not in self._ready]
        if not rows:
            return
        with torch.no_grad():  # not inference_mode: the draft's autograd graph takes these as inputs
            hidden = hidden_states_of_rows(
                self.model,
                self._captured,
                self.verifier.layer_ids,
                [self.input_ids[row] for row in rows],
                self.pad_id,
                self.device,
                "lower train.total_seq_len or use extract.store: files",
            )
        # hidden: [rows, longest, slots, hidden]
        for i, row in enumerate(rows):
            row_hidden = hidden[i, : len(self.input_ids[row])]
            if not bool(torch.isfinite(row_hidden).all()):
                raise EaglenestError(f"the verifier computed non-finite hidden states for prepared row {row}")
            stored = encode_hidden_states(row_hidden, self.dtype)
            self._ready[row] = {**stored, TOKENS_KEY: torch.tensor(self.input_ids[row], dtype=torch.int64)}

    def close(self) -> None:
        """Removes the hooks and drops the verifier."""
        self._hooks.close()
        super().close()
