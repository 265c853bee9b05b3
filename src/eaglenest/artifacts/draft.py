"""The draft checkpoint: what the train stage writes and evaluate (and ``eaglenest serve``) read.

A speculators-format folder: ``config.json`` with ``speculators_model_type: eagle3``, ``speculators_config``
and ``transformer_layer_config``, and ``model.safetensors``. ``speculators.SpeculatorModel.from_pretrained``
loads it and vLLM serves it with ``--speculative-config '{"method": "eagle3", "model": ...}'``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from eaglenest.artifacts.verifier import register_remote_config
from eaglenest.core.atomic import atomic_directory
from eaglenest.core.errors import EaglenestError, InputFileError
from eaglenest.core.safetensors_header import read_header


def save_draft(model: Any, out_dir: Path, verifier_name: str) -> None:
    """Writes the speculators checkpoint; the recorded verifier is the name a server knows, not a local path."""
    model.config.speculators_config.verifier.name_or_path = verifier_name
    with atomic_directory(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)


def draft_tokens(draft_dir: Path, name: str) -> int:
    """K of an EAGLE-3 speculators checkpoint (``models/draft``), checked as vLLM will read it; else one
    line naming ``name`` (the flag or param that pointed at it) and the folder.

    Args:
        draft_dir: The train stage's output folder.
        name: How the user named the draft (``--draft``, ``evaluate: the draft``), for the message.
    """
    config_file = draft_dir / "config.json"
    fix = "use the train stage's output (models/draft; `dvc repro train` builds it)"
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise EaglenestError(f"{name} {draft_dir}: no config.json, not a speculators checkpoint; {fix}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise EaglenestError(f"{name} {config_file}: not readable JSON ({err}); {fix}") from None
    kind = config.get("speculators_model_type") if isinstance(config, dict) else None
    if kind != "eagle3":
        raise EaglenestError(
            f"{name} {draft_dir}: speculators_model_type is {kind!r}, not 'eagle3': not an EAGLE-3 speculators "
            f"checkpoint; {fix}"
        )
    if not (draft_dir / "model.safetensors").is_file():
        raise EaglenestError(f"{name} {draft_dir}: model.safetensors is missing; {fix}")
    try:
        return int(config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    except (KeyError, IndexError, TypeError, ValueError):
        raise EaglenestError(
            f"{name} {config_file}: no speculators_config.proposal_methods[0].speculative_tokens; {fix}"
        ) from None


def load_draft(draft_dir: Path, model_dir: Path, trust_remote_code: bool = False) -> Any:
    """The trained draft, with its verifier pointed at the local weights (the recorded name is a server's)."""
    from speculators import SpeculatorModelConfig
    from speculators.models.eagle3 import Eagle3DraftModel

    if trust_remote_code:
        register_remote_config(model_dir)

    try:
        config = SpeculatorModelConfig.from_pretrained(str(draft_dir))
    except (OSError, ValueError) as err:
        raise EaglenestError(f"{draft_dir}: not a readable speculators checkpoint: {err}") from None
    config.speculators_config.verifier.name_or_path = str(model_dir)
    config.transformer_layer_config._attn_implementation = "sdpa"  # noqa: SLF001 (explicit masks below)
    _check_draft_weights(draft_dir, Eagle3DraftModel(config))
    model = Eagle3DraftModel.from_pretrained(str(draft_dir), config=config)
    model.load_verifier_weights()  # fills anything the checkpoint leaves out (NaN-initialised otherwise)
    for name in ("embed_tokens.weight", "lm_head.weight", "fc.weight"):
        if not torch.isfinite(model.state_dict()[name]).all():
            raise EaglenestError(f"{draft_dir}: {name} was not loaded (non-finite values)")
    return model.float().eval()


def _check_draft_weights(draft_dir: Path, expected_model: Any) -> None:
    """Every tensor the draft needs is in the checkpoint with its shape.

    speculators' from_pretrained leaves a missing or renamed weight at its random initial value without a
    word, so the file is checked against the model's own state dict first.
    """
    weights = draft_dir / "model.safetensors"
    try:
        header = read_header(weights)
    except FileNotFoundError:
        raise InputFileError(f"{weights}: missing; run `dvc repro train`") from None
    except (OSError, ValueError) as err:
        raise InputFileError(f"{weights}: not a safetensors file: {err}") from None
    if header.actual_size != header.expected_size:
        raise InputFileError(f"{weights}: truncated ({header.actual_size} of {header.expected_size} bytes)")
    skipped = set(getattr(expected_model, "_keys_to_ignore_on_save", None) or [])
    for name, tensor in expected_model.state_dict().items():
        if name in skipped:
            continue
        if name not in header.tensors:
            raise InputFileError(f"{weights}: missing tensor {name} {list(tensor.shape)}")
        if header.tensors[name][1] != list(tensor.shape):
            raise InputFileError(
                f"{weights}: tensor {name} has shape {header.tensors[name][1]}, expected {list(tensor.shape)}"
            )
