"""Is this the right interpreter? Standard library only, so it works in the wrong one too.

Stages and ``eaglenest doctor`` call this before importing torch or transformers: a stage started by an
interpreter that lacks the project's dependencies (``python3 stages/prepare.py`` outside the venv, or
``dvc repro`` without ``.venv/bin`` on PATH) gets one line naming that interpreter, the missing modules
and the fix, instead of a ``ModuleNotFoundError`` traceback.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path

# Import name -> distribution name, for everything a stage needs at run time.
STAGE_MODULES: dict[str, str] = {
    "torch": "torch",
    "transformers": "transformers",
    "speculators": "speculators",
    "datasets": "datasets",
    "safetensors": "safetensors",
    "pydantic": "pydantic",
    "yaml": "pyyaml",
    "eaglenest": "eaglenest",
}
FIX = "run `make setup`, then `source .venv/bin/activate` (or use `make demo` / `.venv/bin/python`)"


def missing_modules(modules: dict[str, str] | None = None) -> list[str]:
    """Import names in ``modules`` that this interpreter cannot import (checked without importing)."""
    modules = STAGE_MODULES if modules is None else modules
    return [name for name in modules if importlib.util.find_spec(name) is None]


def require_stage_environment(stage: str) -> None:
    """Exits with status 2 and one line if this interpreter lacks a stage dependency."""
    missing = missing_modules()
    if missing:
        print(
            f"eaglenest {stage}: error: the interpreter {sys.executable} cannot import "
            f"{', '.join(missing)}; it is not the project environment. Fix: {FIX}",
            file=sys.stderr,
        )
        raise SystemExit(2)


def find_project_root(start: Path | None = None) -> Path | None:
    """The nearest directory at or above ``start`` holding both dvc.yaml and params.yaml."""
    here = (start or Path.cwd()).resolve()
    for candidate in (here, *here.parents):
        if (candidate / "dvc.yaml").is_file() and (candidate / "params.yaml").is_file():
            return candidate
    return None


def package_version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
