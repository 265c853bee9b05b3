"""Which torch device a stage runs on: one rule for every ``<stage>.device`` param."""

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
