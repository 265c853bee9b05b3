"""The ``vllm.general_plugins`` entry point: wraps vLLM's model runner so that an engine configuring the drafter
gets it attached, and nothing else changes."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from eaglenest.core.drafter.config import engine_drafter_config, require_pinned_vllm

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: vLLM calls it in every process it starts. It only arranges for the
    model runner to be wrapped when its module is imported (engine processes import it; an API server does not),
    so a process with no drafter configured pays nothing."""
    _when_imported(RUNNER_MODULE, _wrap_runner)


def _wrap_runner(module: ModuleType) -> None:
    """Wraps ``GPUModelRunner.__init__`` (the CPU build's runner subclasses it) once: a runner whose engine
    configures the drafter gets it attached (:func:`eaglenest.core.drafter.runner.attach`); every other runner is
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
            from eaglenest.core.drafter.runner import attach

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
