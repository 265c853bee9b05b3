"""The draft model: speculators' model class for ``train.algorithm``, built for the verifier, saved in
speculators' format.

Each algorithm (:data:`ALGORITHMS`) is speculators' own model, loss and checkpoint format:

* ``eagle3`` — ``Eagle3DraftModel``: K chained draft steps, each fed the layer's previous output, trained with
  training-time test (TTT) over K steps; EAGLE-3.1's two norms are its options.
* ``peagle`` — ``PEagleDraftModel`` (P-EAGLE): the K tokens in one forward; the positions after the first carry a
  learned mask hidden state and the mask token. Its embeddings train too (vocabulary x hidden more weights), and
  its training samples positions at random (COD sampling), from torch's generator, seeded per step and process.
* ``dflash`` — ``DFlashDraftModel`` (DFlash): a block of K + 1 positions (the last verified token, then the
  mask token) drafted at once by Qwen3-style layers that attend to the verifier's aux states. It reads the rows
  unshifted: the verifier's state at t and the token at t line up, as speculators' own trainer gives them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eaglenest.artifacts.verifier import VerifierInfo, register_remote_config
from eaglenest.core.device import cpu_has_native_bf16
from eaglenest.core.registry import Registry
from eaglenest.stages.train.params import DFlashParams, PEagleParams, TrainParams


@dataclass(frozen=True)
class DraftAlgorithm:
    """How one of speculators' draft classes is built and trained.

    Attributes:
        model_class: speculators' class (imported when called: speculators is heavy).
        shifts_rows: Whether batches go through speculators' ``shift_batch`` (EAGLE-3's alignment: the state at t
            beside the token at t + 1).
        build_kwargs: params, mask token id -> the class's ``from_training_args`` keywords beyond the shared ones.
        forward_kwargs: params, resolved loss -> the keywords of every training and validation forward
            (the class's ``get_trainer_kwargs``, from the typed params).
        needs_mask_token: Whether the draft carries a mask token (a param, else resolved from the tokenizer).
    """

    model_class: Callable[[], Any]
    shifts_rows: bool
    build_kwargs: Callable[[TrainParams, int | None], dict[str, Any]]
    forward_kwargs: Callable[[TrainParams, Any], dict[str, Any]]
    needs_mask_token: bool = False


def _eagle3_class() -> Any:
    from speculators.models.eagle3 import Eagle3DraftModel

    return Eagle3DraftModel


def _peagle_class() -> Any:
    from speculators.models.peagle import PEagleDraftModel

    return PEagleDraftModel


def _dflash_class() -> Any:
    from speculators.models.dflash import DFlashDraftModel

    return DFlashDraftModel


def peagle_params(params: TrainParams) -> PEagleParams:
    """``train.peagle``, or its defaults when absent."""
    return params.peagle or PEagleParams()


def dflash_params(params: TrainParams) -> DFlashParams:
    """``train.dflash``, or its defaults when absent."""
    return params.dflash or DFlashParams()


ALGORITHMS: Registry[DraftAlgorithm] = Registry("draft algorithm")
ALGORITHMS.register(
    "eagle3",
    DraftAlgorithm(
        model_class=_eagle3_class,
        shifts_rows=True,
        build_kwargs=lambda p, _mask: {
            "norm_before_residual": p.norm_before_residual,
            "norm_before_fc": p.norm_before_fc,
            "norm_output": p.norm_output,
            "ttt_steps": p.ttt_steps,
        },
        forward_kwargs=lambda p, loss: {
            "ttt_steps": p.ttt_steps,
            "ttt_step_loss_decay": p.ttt_step_loss_decay,
            "loss_config": loss,
        },
    ),
)
ALGORITHMS.register(
    "peagle",
    DraftAlgorithm(
        model_class=_peagle_class,
        shifts_rows=True,
        needs_mask_token=True,
        build_kwargs=lambda p, mask: {
            "norm_before_residual": p.norm_before_residual,
            "norm_before_fc": p.norm_before_fc,
            "mask_token_id": mask,
            "num_depths": p.ttt_steps,
        },
        forward_kwargs=lambda p, loss: {
            "loss_config": loss,
            "num_depths": p.ttt_steps,
            "max_anchors": peagle_params(p).max_anchors,
            "down_sample_ratio": peagle_params(p).down_sample_ratio,
            "down_sample_ratio_min": peagle_params(p).down_sample_ratio_min,
        },
    ),
)
ALGORITHMS.register(
    "dflash",
    DraftAlgorithm(
        model_class=_dflash_class,
        shifts_rows=False,
        needs_mask_token=True,
        build_kwargs=lambda p, mask: {"mask_token_id": mask, "block_size": p.ttt_steps + 1},
        forward_kwargs=lambda p, loss: {
            "loss_config": loss,
            "max_anchors": dflash_params(p).max_anchors,
            "gamma": dflash_params(p).decay_gamma,
        },
    ),
)


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
        ttt_steps: ``train.ttt_steps``: K, the positions the draft is scored on.
        algorithm: ``train.algorithm``.
        forward_kwargs: The algorithm's forward keywords (TTT depth, loss, sampling), fixed for the run.
    """

    device: torch.device
    attention: str
    hs_dtype: torch.dtype
    precision: str
    ttt_steps: int
    algorithm: str
    forward_kwargs: dict[str, Any]

    def autocast(self) -> AbstractContextManager[Any]:
        """A fresh autocast context for one forward (disabled in float32)."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.precision == "bfloat16")

    def forward(self, model: Any, batch: dict[str, Any]) -> tuple[Any, torch.Tensor, dict[str, Any]]:
        """The draft's training forward over a packed batch: (logits or None, loss, speculators' metric sums)."""
        return model(**batch, **self.forward_kwargs)


def separate_fused_loss_configs() -> None:
    """Gives the fused losses' backward Triton kernel its own autotune configs (idempotent).

    speculators 0.9 decorates the forward and the backward kernel with one ``triton.autotune``, so both hold one
    list of the same ``triton.Config`` objects. On CUDA speculators compiles the draft's forward, and torch.compile
    (2.11) traces the loss's backward inside it: it refuses one list reached from two sources ("ListVariable ... is
    already tracked for mutation"), so every GPU training step failed. A deep copy gives the backward kernel the same
    candidates as objects of its own.
    """
    import copy

    from speculators.losses import fused

    forward, backward = fused.loss_forward_kernel, fused.loss_backward_kernel
    if backward.configs is forward.configs or any(
        b is f for b, f in zip(backward.configs, forward.configs, strict=False)
    ):
        backward.configs = copy.deepcopy(backward.configs)


def draft_runtime(params: TrainParams, device: torch.device) -> Runtime:
    """The :class:`Runtime` for ``device``; ``train.attention: auto`` picks by device."""
    from speculators.losses import resolve_loss_config

    cuda = device.type == "cuda"
    attention = params.attention if params.attention != "auto" else ("simple_flex_attention" if cuda else "sdpa")
    loss_config = resolve_loss_config(params.loss, "fused" if cuda else "eager")
    if cuda:
        separate_fused_loss_configs()
    precision = (
        params.precision if params.precision != "auto" else ("bfloat16" if cuda or cpu_has_native_bf16() else "float32")
    )
    # Hidden states come in bf16 only where the GPU computes in bf16: a float32 draft on CUDA needs float32
    # inputs, and on a CPU autocast casts them per matmul anyway.
    hs_dtype = torch.bfloat16 if cuda and precision == "bfloat16" else torch.float32
    forward_kwargs = ALGORITHMS.get(params.algorithm).forward_kwargs(params, loss_config)
    return Runtime(
        device=device,
        attention=attention,
        hs_dtype=hs_dtype,
        precision=precision,
        ttt_steps=params.ttt_steps,
        algorithm=params.algorithm,
        forward_kwargs=forward_kwargs,
    )


def mask_token_id(params: TrainParams, model_dir: Path, vocab_size: int, trust_remote_code: bool) -> int | None:
    """The mask token of a peagle or dflash draft: the param, else speculators' choice from the tokenizer (its
    mask token, else pad, eos or unk); None for eagle3."""
    if not ALGORITHMS.get(params.algorithm).needs_mask_token:
        return None
    section = peagle_params(params) if params.algorithm == "peagle" else dflash_params(params)
    if section.mask_token_id is not None:
        return section.mask_token_id
    from speculators.train.utils import resolve_mask_token_id

    return resolve_mask_token_id(str(model_dir), vocab_size, trust_remote_code=trust_remote_code)


def build_draft(
    verifier: VerifierInfo,
    model_dir: Path,
    params: TrainParams,
    draft_vocab_size: int,
    d2t: torch.Tensor | None,
    t2d: torch.Tensor | None,
    attention: str,
) -> Any:
    """speculators' draft of ``train.algorithm`` for this verifier, its frozen parts loaded from the verifier."""
    from speculators.train.cli import create_transformer_layer_config

    layer_config = create_transformer_layer_config(
        str(model_dir),
        num_layers=params.num_layers,
        draft_arch=params.draft_layer,
        hidden_act=None,
        sliding_window=verifier.max_position_embeddings or 4096,
        full_attention_indices=list(range(params.num_layers)),  # plain causal attention, as vLLM serves it
        trust_remote_code=verifier.trust_remote_code,
    )
    if verifier.trust_remote_code:
        register_remote_config(model_dir)
    algorithm = ALGORITHMS.get(params.algorithm)
    mask = mask_token_id(params, model_dir, layer_config.vocab_size, verifier.trust_remote_code)
    torch.manual_seed(params.seed)
    return algorithm.model_class().from_training_args(
        verifier_config=layer_config,
        t2d=t2d,
        d2t=d2t,
        draft_vocab_size=draft_vocab_size,
        verifier_name_or_path=str(model_dir),
        target_layer_ids=list(verifier.aux_layers),
        draft_attn_impl=attention,
        trust_remote_code=verifier.trust_remote_code,
        **algorithm.build_kwargs(params, mask),
    )
