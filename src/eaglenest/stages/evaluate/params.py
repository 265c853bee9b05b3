"""What the evaluate stage reads of params.yaml: its own section (its schema, :mod:`eaglenest.artifacts.eval_params`,
sits below the stages because the k_sweep and free_sweep stages read it too)."""

from __future__ import annotations

from pydantic import Field

from eaglenest.artifacts.eval_params import EvaluateParams
from eaglenest.core.params import StageParams


class EvaluateStageParams(StageParams):
    """What the evaluate stage reads of params.yaml."""

    evaluate: EvaluateParams = Field(default_factory=EvaluateParams, description="The evaluate stage.")
