"""The draft checkpoint: what the train stage writes and evaluate (and ``eaglenest serve``) read.

A speculators-format folder: ``config.json`` with ``speculators_model_type`` (``eagle3``, ``peagle`` or
``dflash``: ``train.algorithm``), ``speculators_config`` and ``transformer_layer_config``, and
``model.safetensors``. ``speculators.SpeculatorModel.from_pretrained`` loads it and vLLM serves it with the
``--speculative-config`` :func:`vllm_speculative_config` writes (``{"method": "eagle3", "model": ...}`` for
EAGLE-3).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eaglenest.artifacts.verifier import register_remote_config
from eaglenest.core.atomic import atomic_directory
from eaglenest.core.errors import EaglenestError, InputFileError
from eaglenest.core.json_file import read_json
from eaglenest.core.safetensors_header import read_header


def save_draft(model: Any, out_dir: Path, verifier_name: str) -> None:
    """Writes the speculators checkpoint; the recorded verifier is the name a server knows, not a local path."""
    model.config.speculators_config.verifier.name_or_path = verifier_name
    with atomic_directory(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)


DRAFT_FIX = "use the train stage's output (models/draft; `dvc repro train` builds it)"

# speculators_model_type -> vLLM's speculative_config method. vLLM 0.32 serves a P-EAGLE checkpoint as EAGLE-3
# with parallel drafting, but only when told so: given no method, it takes the folder for a plain draft model
# and fails at the first step.
VLLM_METHODS: dict[str, dict[str, Any]] = {
    "eagle3": {"method": "eagle3"},
    "peagle": {"method": "eagle3", "parallel_drafting": True},
    "dflash": {"method": "dflash"},
}


def draft_algorithm(draft_dir: Path, name: str) -> str:
    """The ``speculators_model_type`` of a draft folder vLLM can serve (``train.algorithm``); else one line naming
    ``name`` (the flag or param that pointed at it) and the folder."""
    return _read_config(draft_dir, name)["speculators_model_type"]


def vllm_speculative_config(draft_dir: Path, k: int) -> dict[str, Any]:
    """vLLM's ``speculative_config`` serving the draft at K = ``k`` (``draft_dir`` as given: a path vLLM opens)."""
    method = VLLM_METHODS[draft_algorithm(draft_dir, "the draft")]
    return {**method, "model": str(draft_dir), "num_speculative_tokens": k}


def draft_tokens(draft_dir: Path, name: str) -> int:
    """K of a speculators checkpoint (``models/draft``), checked as vLLM will read it; else one line naming
    ``name`` (the flag or param that pointed at it) and the folder.

    Args:
        draft_dir: The train stage's output folder.
        name: How the user named the draft (``--draft``, ``the draft``), for the message.
    """
    config = _read_config(draft_dir, name)
    try:
        return int(config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    except (KeyError, IndexError, TypeError, ValueError):
        raise EaglenestError(
            f"{name} {draft_dir / 'config.json'}: no speculators_config.proposal_methods[0].speculative_tokens; "
            f"{DRAFT_FIX}"
        ) from None


def _read_config(draft_dir: Path, name: str) -> dict[str, Any]:
    """The draft's config.json, checked to be a speculators checkpoint of a kind vLLM serves, with weights."""
    config_file = draft_dir / "config.json"
    config = read_json(
        config_file,
        f"{name} {draft_dir}: no config.json, not a speculators checkpoint; {DRAFT_FIX}",
        DRAFT_FIX,
        named=f"{name} {config_file}",
    )
    kind = config.get("speculators_model_type") if isinstance(config, dict) else None
    if kind not in VLLM_METHODS:
        raise EaglenestError(
            f"{name} {draft_dir}: speculators_model_type is {kind!r}, not one of {', '.join(VLLM_METHODS)}: not a "
            f"speculators draft this pipeline trains; {DRAFT_FIX}"
        )
    if not (draft_dir / "model.safetensors").is_file():
        raise EaglenestError(f"{name} {draft_dir}: model.safetensors is missing; {DRAFT_FIX}")
    return config


def load_draft(draft_dir: Path, model_dir: Path, trust_remote_code: bool = False) -> Any:
    """The trained draft, with its verifier pointed at the local weights (the recorded name is a server's)."""
    from speculators import SpeculatorModelConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    if trust_remote_code:
        register_remote_config(model_dir)

    try:
        config = SpeculatorModelConfig.from_pretrained(str(draft_dir))
    except (OSError, ValueError) as err:
        raise EaglenestError(f"{draft_dir}: not a readable speculators checkpoint: {err}") from None
    if not isinstance(config, Eagle3SpeculatorConfig):  # speculators' registry gives each type its own config class
        raise EaglenestError(
            f"{draft_dir}: a {config.speculators_model_type} draft; the reference decoder decodes "
            "EAGLE-3 drafts only (vLLM serves the others)"
        )
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
