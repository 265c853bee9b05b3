"""``verifier:`` in params.yaml: the verifier stage's params, and what the stage reads of the file."""

from __future__ import annotations

from pydantic import Field, field_validator

from eaglenest.core.params import StageParams, StrictModel


class VerifierParams(StrictModel):
    """``verifier:`` — which LLM the draft is trained for."""

    model: str = Field(
        default="builtin:smollm2-135m-instruct",
        min_length=1,
        description=(
            "The verifier: 'builtin:<name>' (materialised into models/verifier/), a local directory with "
            "config.json and safetensors weights, or a model id already in the local Hugging Face cache. "
            "External models are used in place and recorded by reference, never copied."
        ),
    )
    trust_remote_code: bool = Field(
        default=False,
        description="Allow the verifier's own modelling code (config.json 'auto_map') to run. Off by default.",
    )
    aux_layers: list[int] | None = Field(
        default=None,
        description=(
            "Decoder layer ids whose residual stream feeds the draft (EAGLE-3 'aux' layers), each in "
            "1..N-1 for an N-layer verifier, distinct. null means [2, N//2, N-3]."
        ),
    )
    name: str | None = Field(
        default=None,
        description=(
            "The name a server knows the verifier by (recorded in the draft checkpoint). null means the "
            "built-in's hub id, or the local model's directory name / model id."
        ),
    )

    @field_validator("aux_layers")
    @classmethod
    def _aux_layers_distinct_positive(cls, value: list[int] | None) -> list[int] | None:
        if value is None:
            return None
        if len(value) == 0:
            raise ValueError("must list at least one layer id, or be null for the default [2, N//2, N-3]")
        if len(set(value)) != len(value):
            raise ValueError("layer ids must be distinct")
        if min(value) < 1:
            raise ValueError("layer ids must be >= 1 (0 is the embeddings, not a decoder layer)")
        return sorted(value)


class VerifierStageParams(StageParams):
    """What the verifier stage reads of params.yaml."""

    verifier: VerifierParams = Field(default_factory=VerifierParams, description="The verifier stage.")
