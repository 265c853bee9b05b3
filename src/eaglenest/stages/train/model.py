"""The draft model: speculators' Eagle3DraftModel built for the verifier, and saved in speculators' format."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eaglenest.artifacts.verifier import VerifierInfo, register_remote_config
from eaglenest.core.device import cpu_has_native_bf16
from eaglenest.core.params import TrainParams


@dataclass(frozen=True)
class Runtime:
    """How the draft runs on this device: ``sdpa`` attention and the eager loss on CPU (speculators' fused
    losses need Triton), flex attention and the fused loss on GPU; bf16 autocast where the device computes
    bf16 natively (``train.precision``).

    Attributes:
        device: Where the model and batches live.
        attention: The draft's attention implementation.
        hs_dtype: The dtype hidden states are loaded in.
        precision: The compute dtype autocast runs the draft in ("float32" or "bfloat16").
        ttt_steps: ``train.ttt_steps``: how many steps each forward unrolls.
        ttt_step_loss_decay: ``train.ttt_step_loss_decay``.
        loss_config: speculators' resolved loss (``train.loss``, in the implementation this device runs).
    """

    device: torch.device
    attention: str
    hs_dtype: torch.dtype
    precision: str
    ttt_steps: int
    ttt_step_loss_decay: float
    loss_config: Any

    def autocast(self) -> AbstractContextManager[Any]:
        """A fresh autocast context for one forward (disabled in float32)."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.precision == "bfloat16")

    def forward(self, model: Any, batch: dict[str, Any]) -> tuple[Any, torch.Tensor, dict[str, Any]]:
        """The draft's TTT forward over a packed batch: (logits, loss, speculators' accuracy sums)."""
        return model(**batch, ttt_steps=self.ttt_steps, ttt_step_loss_decay=self.ttt_step_loss_decay,
                     loss_config=self.loss_config)


def draft_runtime(params: TrainParams, device: torch.device) -> Runtime:
    """The :class:`Runtime` for ``device``; ``train.attention: auto`` picks by device."""
    from speculators.losses import resolve_loss_config

    cuda = device.type == "cuda"
    attention = params.attention if params.attention != "auto" else ("simple_flex_attention" if cuda else "sdpa")
    loss_config = resolve_loss_config(params.loss, "fused" if cuda else "eager")
    precision = params.precision if params.precision != "auto" else (
        "bfloat16" if cuda or cpu_has_native_bf16() else "float32")
    # Hidden states come in bf16 only where the GPU computes in bf16: a float32 draft on CUDA needs float32
    # inputs, and on a CPU autocast casts them per matmul anyway.
    hs_dtype = torch.bfloat16 if cuda and precision == "bfloat16" else torch.float32
    return Runtime(device=device, attention=attention, hs_dtype=hs_dtype, precision=precision,
                   ttt_steps=params.ttt_steps, ttt_step_loss_decay=params.ttt_step_loss_decay,
                   loss_config=loss_config)


def build_draft(verifier: VerifierInfo, model_dir: Path, params: TrainParams, draft_vocab_size: int,
                d2t: torch.Tensor | None, t2d: torch.Tensor | None, attention: str) -> Any:
    """speculators' Eagle3DraftModel for this verifier, with its embedding, LM head and norm frozen."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    layer_config = create_transformer_layer_config(
        str(model_dir), num_layers=params.num_layers, draft_arch=params.draft_arch, hidden_act=None,
        sliding_window=verifier.max_position_embeddings or 4096,
        full_attention_indices=list(range(params.num_layers)),  # plain causal attention, as vLLM serves it
        trust_remote_code=verifier.trust_remote_code,
    )
    if verifier.trust_remote_code:
        register_remote_config(model_dir)
    torch.manual_seed(params.seed)
    return Eagle3DraftModel.from_training_args(
        verifier_config=layer_config, t2d=t2d, d2t=d2t, draft_vocab_size=draft_vocab_size,
        norm_before_residual=params.norm_before_residual, ttt_steps=params.ttt_steps,
        verifier_name_or_path=str(model_dir), target_layer_ids=list(verifier.aux_layers),
        draft_attn_impl=attention, trust_remote_code=verifier.trust_remote_code,
    )


