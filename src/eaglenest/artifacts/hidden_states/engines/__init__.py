"""The hidden-state engines: the back ends that compute a verifier's hidden states (``extract.backend``: hf, vllm,
import), built by one registry. The extract stage runs them on its tasks and stores what they compute; with
``extract.store: stream`` the train stage runs them on its batches
(:mod:`eaglenest.artifacts.hidden_states.stream`). Back ends import their contract (:mod:`.contract`), never this
registry; each is imported only when built (vLLM only where it runs).
"""

from __future__ import annotations

from typing import Any

from eaglenest.artifacts.hidden_states.engines.contract import Engine, EngineSettings
from eaglenest.artifacts.hidden_states.extract_params import ExtractParams
from eaglenest.core.executor import EngineNeeds
from eaglenest.core.registry import Registry

# extract.backend -> builds its engine; each imports its module only when called (vLLM only where it runs).
BACKENDS: Registry[Any] = Registry("extract back end")


@BACKENDS.entry("hf")
def _hf(settings: EngineSettings) -> Engine:
    from eaglenest.artifacts.hidden_states.engines.hf import HfEngine

    return HfEngine(settings)


@BACKENDS.entry("vllm")
def _vllm(settings: EngineSettings) -> Engine:
    from eaglenest.artifacts.hidden_states.engines.vllm import VllmExtractEngine  # imports vllm once its engine starts

    return VllmExtractEngine(settings)


@BACKENDS.entry("import")
def _import(settings: EngineSettings) -> Engine:
    from eaglenest.artifacts.hidden_states.engines.imported import ImportEngine

    return ImportEngine(settings)


def make_engine(settings: EngineSettings) -> Engine:
    """The engine of ``extract.backend`` (run where the executor runs it: here, or in a Ray actor)."""
    return BACKENDS.get(settings.params.backend)(settings)


def engine_needs(params: ExtractParams) -> EngineNeeds:
    """What one engine of ``extract.backend`` takes from a node of a Ray cluster."""
    if params.backend == "vllm":
        return EngineNeeds(params.vllm.tensor_parallel_size, "extract.vllm.tensor_parallel_size")
    return EngineNeeds(None if params.device == "cpu" else 1, "extract.device")
