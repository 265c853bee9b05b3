"""What the plan stage reads of params.yaml: no section of its own, evaluate's sets, seed and bootstrap (the same
view of ``evaluate:`` the k_sweep stage reads)."""

from __future__ import annotations

from pydantic import Field

from eaglenest.artifacts.eval_params import EvalSetsAndEngines
from eaglenest.core.params import StageParams


class PlanStageParams(StageParams):
    """What the plan stage reads of params.yaml: which of evaluate's sets are headline, its seed and bootstrap."""

    evaluate: EvalSetsAndEngines = Field(
        default_factory=EvalSetsAndEngines,
        description="The evaluate stage's sets (the headline ones are pooled), seed and bootstrap.",
    )
