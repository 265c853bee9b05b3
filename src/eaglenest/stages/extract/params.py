"""What the extract stage reads of params.yaml: its own section (its schema:
:mod:`eaglenest.artifacts.hidden_states.extract_params`), and ``cluster``."""

from __future__ import annotations

from pydantic import Field

from eaglenest.artifacts.hidden_states.extract_params import ExtractParams
from eaglenest.core.params import CLUSTER_DESCRIPTION, ClusterParams, StageParams


class ExtractStageParams(StageParams):
    """What the extract stage reads of params.yaml: its own section, and ``cluster`` (where it runs)."""

    extract: ExtractParams = Field(default_factory=ExtractParams, description="The extract stage.")
    cluster: ClusterParams = Field(default_factory=ClusterParams, description=CLUSTER_DESCRIPTION)
