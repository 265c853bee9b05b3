"""Which torch device a stage runs on: one rule for every ``<stage>.device`` param; what the CPU computes natively."""

from __future__ import annotations

import torch

from eaglenest.core.errors import EaglenestError


def pick_device(requested: str, param: str) -> torch.device:
    """'auto' is CUDA when present, else CPU; 'cuda' without a GPU is an error naming ``param``.

    Args:
        requested: The param's value: "auto", "cpu" or "cuda".
        param: The params key that asked (``extract.device``, ``train.device``), named in the message.
    """
    if requested == "cuda" and not torch.cuda.is_available():
        raise EaglenestError(f"{param} = 'cuda' but torch sees no GPU; use 'auto' or 'cpu'")
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX). Elsewhere oneDNN emulates bf16, which
    is slower than float32, so the ``auto`` precisions (``train.precision``, vLLM's ``dtype``) keep float32."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
