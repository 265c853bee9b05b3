"""The verifier's decoder forward with its residual stream captured: shared by the extract stage's hf back end
and by online training (``extract.store: online``), which must compute the same hidden states.

Only the decoder runs (no LM head: unused here). Hooks capture the residual stream after each aux layer (the
output of decoder layer ``L-1`` is "layer id L") and the input of the final norm (layer id N, pre-norm;
transformers' own last ``hidden_states`` entry is taken after the norm, so it cannot be used).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eaglenest.core.errors import EaglenestError


def decoder_dtype(device: torch.device) -> torch.dtype:
    """What the verifier's decoder computes in on ``device``: fp32 on CPU (bf16 matmuls are slow without native
    bf16), bf16 on GPU."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def load_decoder(model_dir: Path, trust_remote_code: bool, device: torch.device) -> nn.Module:
    """The verifier's base model (no LM head), in :func:`decoder_dtype` on ``device``."""
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    dtype = decoder_dtype(device)
    # The checkpoint's lm_head.weight is deliberately not loaded; silence the "UNEXPECTED key" report.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = AutoModel.from_pretrained(model_dir, dtype=dtype, trust_remote_code=trust_remote_code)
    finally:
        hf_logging.set_verbosity(verbosity)
    return model.to(device).eval()


def decoder_parts(model: nn.Module) -> tuple[nn.ModuleList, nn.Module]:
    """The decoder layers and the final norm of a transformers base model."""
    for candidate in (model, getattr(model, "language_model", None), getattr(model, "model", None)):
        layers = getattr(candidate, "layers", None)
        norm = getattr(candidate, "norm", None)
        if isinstance(layers, nn.ModuleList) and isinstance(norm, nn.Module):
            return layers, norm
    config = getattr(model, "config", None)
    name = getattr(config, "_name_or_path", "") or type(model).__name__
    raise EaglenestError(
        f"verifier {name} ({getattr(config, 'model_type', 'unknown model type')}, {type(model).__name__}): no "
        "`.layers` list and final `.norm` where the hf back end looks for them (Llama, Qwen, Mistral, DeepSeek "
        "and most decoder-only families have them), so its aux layers cannot be hooked; fix: extract.backend: "
        "vllm (vLLM's own model classes expose their layers; with extract.store: files), or extract.backend: "
        "import with hidden states another tool wrote"
    )


@contextmanager
def capture_residual_stream(model: nn.Module, layer_ids: list[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Hooks that fill ``{layer_id: [batch, seq, hidden]}`` on every forward.

    Layer id L < N is the output of decoder layer L-1; layer id N is the final norm's input.
    """
    layers, norm = decoder_parts(model)
    num_layers = len(layers)
    captured: dict[int, torch.Tensor] = {}
    handles = []

    def keep_output(layer_id: int):
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    def keep_norm_input(_module: nn.Module, args: tuple[Any, ...]) -> None:
        captured[num_layers] = args[0]

    for layer_id in layer_ids:
        if layer_id == num_layers:
            handles.append(norm.register_forward_pre_hook(keep_norm_input))
        elif 1 <= layer_id < num_layers:
            handles.append(layers[layer_id - 1].register_forward_hook(keep_output(layer_id)))
        else:
            raise EaglenestError(f"layer id {layer_id} is outside 1..{num_layers}")
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def pad_batch(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` and ``attention_mask``, both ``[batch, longest]``.

    Right padding keeps every real token's positions and causal context exactly as unpadded.
    """
    longest = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), longest), dtype=torch.long)
    for i, seq in enumerate(sequences):
        input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention_mask[i, : len(seq)] = 1
    return input_ids, attention_mask


def forward_hidden_states(
    model: nn.Module,
    captured: dict[int, torch.Tensor],
    layer_ids: list[int],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
) -> torch.Tensor:
    """One decoder forward; returns ``[batch, seq, n_slots, hidden]`` in ``layer_ids`` order."""
    captured.clear()
    model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return torch.stack([captured[layer_id] for layer_id in layer_ids], dim=2)


def hidden_states_of_rows(
    model: nn.Module,
    captured: dict[int, torch.Tensor],
    layer_ids: list[int],
    sequences: list[list[int]],
    pad_id: int,
    device: torch.device,
    fix: str,
) -> torch.Tensor:
    """One right-padded decoder forward over ``sequences``: ``[batch, longest, n_slots, hidden]``.

    Running out of memory is one line: the batch's size, then ``fix``.
    """
    input_ids, attention_mask = pad_batch(sequences, pad_id)
    try:
        return forward_hidden_states(model, captured, layer_ids, input_ids.to(device), attention_mask.to(device))
    except (torch.OutOfMemoryError, MemoryError):
        raise EaglenestError(
            f"out of memory on {device} for a batch of {len(sequences)} rows x {input_ids.shape[1]} tokens; {fix}"
        ) from None
