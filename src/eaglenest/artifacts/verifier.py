"""The verifier record: ``verifier.json``, what the verifier stage writes and every later stage reads.

It holds the layer count N, hidden size, vocabulary size and aux layer ids, and says where the weights are:
next to it (``kind: builtin``, materialised by the verifier stage) or at the recorded local path or Hugging
Face cache id, used in place. :func:`load_verifier_info` reads and validates it; :func:`write_verifier_record`
writes it into the stage's (temporary) output folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from eaglenest.core.atomic import atomic_write_json
from eaglenest.core.errors import EaglenestError, ParamsError

INFO_FILE = "verifier.json"
# Where this machine keeps an external verifier when its copy is not at verifier.model: the record, an output every
# clone shares, keeps params' value and the weights' fingerprint; each machine names its own copy here, so neither
# params.yaml nor any output changes from one machine to the next.
VERIFIER_PATH_ENV = "EAGLENEST_VERIFIER_PATH"


class VerifierInfo(BaseModel):
    """What the verifier stage records in ``verifier.json`` for every later stage."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(description="verifier.model as given in params.")
    kind: Literal["builtin", "local", "hf-cache"] = Field(description="How the model was resolved.")
    path: str = Field(
        description="'.' for a model materialised next to this file; else the local path or cache model id."
    )
    name: str = Field(description="The name a server knows the verifier by.")
    fingerprint: str = Field(description="sha256 of config.json and the weight index / safetensors headers.")
    model_type: str = Field(description="config.json model_type.")
    num_layers: int = Field(description="N, the number of decoder layers.")
    hidden_size: int = Field(description="Width of the residual stream.")
    vocab_size: int = Field(description="Verifier vocabulary size.")
    max_position_embeddings: int | None = Field(description="Longest context the verifier supports.")
    aux_layers: list[int] = Field(description="Sorted aux layer ids (1..N-1) that feed the draft.")
    layer_ids: list[int] = Field(description="Hidden-state slots: the aux layers, then N (pre-norm output).")
    trust_remote_code: bool = Field(description="Whether the model's own code may run.")


def hf_cache_path(model_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id=model_id, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError) as err:
        raise ParamsError(
            f"verifier.model = {model_id!r}: not a local directory, and not in the local Hugging Face "
            f"cache ({type(err).__name__}); eaglenest never downloads at run time: download it first "
            f"(`hf download {model_id}`) or give a local path"
        ) from None


def verifier_path_override() -> Path | None:
    """This machine's copy of the external verifier (:data:`VERIFIER_PATH_ENV`), or None where unset.

    Raises:
        ParamsError: the variable names no folder.
    """
    value = os.environ.get(VERIFIER_PATH_ENV)
    if not value:
        return None
    path = Path(value).expanduser()
    if not path.is_dir():
        raise ParamsError(
            f"{VERIFIER_PATH_ENV}={value!r}: no such folder; set it to this machine's copy of the "
            "verifier in params' verifier.model, or unset it"
        )
    return path


def resolve_model_path(source: str, kind: str) -> Path:
    """Where the weights of a recorded (non-built-in) verifier are on this machine: :data:`VERIFIER_PATH_ENV` where
    set, else the recorded path or cache id."""
    override = verifier_path_override()
    if override is not None:
        return override
    return hf_cache_path(source) if kind == "hf-cache" else Path(source)


def load_verifier_info(verifier_dir: Path) -> tuple[VerifierInfo, Path]:
    """Reads the verifier stage's record; returns it with the model folder on this machine."""
    info_file = Path(verifier_dir) / INFO_FILE
    try:
        info = VerifierInfo.model_validate_json(info_file.read_bytes())
    except FileNotFoundError:
        raise EaglenestError(
            f"{info_file} does not exist; run the verifier stage first (`dvc repro verifier`)"
        ) from None
    except ValueError as err:
        raise EaglenestError(
            f"{info_file}: not a valid verifier record ({err}); rerun `dvc repro -f verifier`"
        ) from None
    path = Path(verifier_dir) if info.kind == "builtin" else resolve_model_path(info.path, info.kind)
    return info, path


def load_tokenizer(verifier_dir: Path) -> Any:
    """The verifier's tokenizer, refusing one without a chat template."""
    from transformers import AutoTokenizer

    info, path = load_verifier_info(verifier_dir)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=info.trust_remote_code)
    if not getattr(tokenizer, "chat_template", None):
        raise EaglenestError(
            f"the verifier's tokenizer ({path}) has no chat template; eaglenest renders conversations with "
            "the verifier's own template, so use an instruct/chat model"
        )
    return tokenizer


def register_remote_config(model_dir: Path) -> None:
    """Makes a remote-code verifier's config class known to transformers' AutoConfig.

    speculators 0.9's ``Eagle3DraftModel.load_verifier_weights`` (run when a draft is built and when one is
    loaded) reads the verifier's config with ``AutoConfig.from_pretrained(path)`` and no
    ``trust_remote_code``, so a verifier whose model type only its own code defines stops it. Callers load the
    class here, only with ``verifier.trust_remote_code: true``, and it is registered under its model type.
    """
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=True)
    if config.model_type not in CONFIG_MAPPING:
        AutoConfig.register(config.model_type, type(config), exist_ok=True)


def write_verifier_record(directory: Path, info: VerifierInfo) -> None:
    """Writes ``verifier.json`` into ``directory`` (the verifier stage's temporary output folder)."""
    atomic_write_json(Path(directory) / INFO_FILE, info.model_dump())
