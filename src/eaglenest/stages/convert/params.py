"""``convert:`` in params.yaml: the convert stage's params, and what the stage reads of the file (its own section
and the storage settings of ``extract``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from eaglenest.core.params import HiddenStateStorage, StageParams, StrictModel


class ConvertParams(StrictModel):
    """``convert:`` — validate the hidden states and build the draft vocabulary."""

    draft_vocab_size: int | None = Field(
        default=4096,
        ge=1,
        description=(
            "Tokens the draft predicts: the most frequent loss-masked tokens of the train split (speculators' "
            "d2t/t2d). 8192 suits SmolLM2's 49152; null keeps the verifier's full vocabulary."
        ),
    )
    on_bad: Literal["fail", "skip"] = Field(
        default="fail",
        description="A row whose hidden states fail validation: 'fail' stops; 'skip' excludes it (recorded).",
    )
    workers: int = Field(default=2, ge=1, description="Threads reading hidden-state files during validation.")


class ConvertStageParams(StageParams):
    """What the convert stage reads of params.yaml: its own section, and how extract stored the hidden states."""

    convert: ConvertParams = Field(default_factory=ConvertParams, description="The convert stage.")
    extract: HiddenStateStorage = Field(
        default_factory=HiddenStateStorage,
        description="The extract stage's storage settings (store, dtype): what the hidden states it validates are.",
    )
