"""Installs suffix decoding (Arctic Inference's ``arctic_inference.suffix_decoding``) into the venv, built once.

vLLM's ``method: suffix`` and eaglenest's hybrid drafter need ``arctic-inference``, whose releases carry no wheel for
this Python; its sdist builds on a CPU in well under a minute (C++ and nanobind) against the venv's torch. So
``make setup`` runs this after the main install, with the venv's interpreter, and:

1. the venv already holds the pinned version, and its suffix module imports: nothing to do;
2. a wheel built earlier for this interpreter and this torch is in the wheel cache: installed from there;
3. otherwise: the build tools (``nanobind``, ``wheel``) into the venv, then ``pip wheel --no-deps
   --no-build-isolation`` from pip's configured sources, with ``CMAKE_ARGS=-DPython_EXECUTABLE=<this python>`` (else
   CMake's FindPython picks another interpreter, one without nanobind); the wheel is kept in the cache and installed
   with ``--no-deps`` (its declared deps pin another vLLM). Where that fails: one line naming what failed, pip's
   output in a log in the wheel cache, and exit status 1.

    .venv/bin/python scripts/suffix_decoding.py arctic-inference==0.3.0
    .venv/bin/python scripts/suffix_decoding.py arctic-inference==0.3.0 --decide   # print the decision only

The cache is ``$EAGLENEST_WHEEL_CACHE``, else ``~/.cache/eaglenest/wheels`` (created 0700: a wheel another user
could replace would run as code here). The pin is the Makefile's ``SUFFIX_DECODING``. Standard library only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import _pins  # scripts/, next to this file
from _pins import installed_version

INSTALLED = "installed"
CACHED = "cached"
BUILD = "build"
LOG_NAME = "suffix-decoding-build.log"
CACHE_ENV = "EAGLENEST_WHEEL_CACHE"
MODULE = "arctic_inference.suffix_decoding"
# What the sdist's build needs in the venv (no build isolation: an isolated build would try to build torch).
BUILD_TOOLS = ("nanobind==2.9.2", "wheel", "setuptools>=61.0")


def parse_pin(text: str) -> tuple[str, str]:
    """``name==version`` as ``(name, version)``; anything else stops with one line."""
    return _pins.parse_pin(text, "suffix_decoding.py", "SUFFIX_DECODING")


def module_imports() -> bool:
    """Whether the suffix module imports in a fresh interpreter (a stale or broken build counts as absent)."""
    return subprocess.run([sys.executable, "-c", f"import {MODULE}"], capture_output=True).returncode == 0


def cache_root(environ: dict[str, str] | None = None) -> Path:
    """Where built wheels are kept: ``$EAGLENEST_WHEEL_CACHE`` or ``~/.cache/eaglenest/wheels``."""
    environ = os.environ if environ is None else environ
    return Path(environ[CACHE_ENV]) if environ.get(CACHE_ENV) else Path.home() / ".cache" / "eaglenest" / "wheels"


def cache_dir(root: Path, name: str, version: str, torch_version: str | None) -> Path:
    """The folder for one build: the wheel's own name carries the interpreter and platform, this the torch."""
    return root / f"{name}-{version}" / f"torch-{torch_version or 'none'}" / sysconfig.get_platform()


def cached_wheel(folder: Path, name: str, version: str) -> Path | None:
    """A wheel of ``name==version`` for this interpreter in ``folder``, or None."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    stem = f"{name.replace('-', '_')}-{version}-{tag}-"
    found = sorted(folder.glob(f"{stem}*.whl")) if folder.is_dir() else []
    return found[0] if found else None


def decide(name: str, version: str, folder: Path) -> str:
    """``installed``, ``cached`` or ``build``."""
    if installed_version(name) == version and module_imports():
        return INSTALLED
    return CACHED if cached_wheel(folder, name, version) else BUILD


def make_private_dir(path: Path) -> None:
    """Creates ``path`` (and its parents) readable by this user alone; refuses one another user owns."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.stat().st_uid != os.getuid():
        raise SystemExit(f"suffix_decoding.py: the wheel cache {path} belongs to another user; set {CACHE_ENV}")


def pip(args: list[str], log: Path, environ: dict[str, str] | None = None) -> bool:
    """Runs ``python -m pip ARGS``, appending its output to ``log``; whether it succeeded."""
    with log.open("a") as out:
        out.write(f"$ pip {' '.join(args)}\n")
        out.flush()
        result = subprocess.run([sys.executable, "-m", "pip", *args], stdout=out, stderr=subprocess.STDOUT, env=environ)
    return result.returncode == 0


def build(name: str, version: str, folder: Path, log: Path) -> Path:
    """Builds the wheel into ``folder`` (through a temporary folder beside it: a half-built wheel is never cached)."""
    if not pip(["install", "-q", *BUILD_TOOLS], log):
        raise SystemExit(f"suffix_decoding.py: could not install the build tools {' '.join(BUILD_TOOLS)}; see {log}")
    make_private_dir(folder)
    environ = dict(os.environ, CMAKE_ARGS=f"-DPython_EXECUTABLE={sys.executable}")
    with tempfile.TemporaryDirectory(dir=folder, prefix=".build-") as scratch:
        args = ["wheel", "-q", "--no-deps", "--no-build-isolation", f"{name}=={version}", "-w", scratch]
        if not pip(args, log, environ):
            raise SystemExit(f"suffix_decoding.py: building {name}=={version} from its sdist failed; see {log}")
        built = cached_wheel(Path(scratch), name, version)
        if built is None:
            raise SystemExit(f"suffix_decoding.py: pip built no {name}=={version} wheel for this Python; see {log}")
        target = folder / built.name
        os.replace(built, target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pin", help="NAME==VERSION of the suffix decoding package (the Makefile's SUFFIX_DECODING)")
    parser.add_argument("--decide", action="store_true", help="print installed, cached or build and change nothing")
    args = parser.parse_args(argv)
    name, version = parse_pin(args.pin)
    folder = cache_dir(cache_root(), name, version, installed_version("torch"))
    decision = decide(name, version, folder)
    if args.decide:
        print(decision)
        return 0
    if decision == INSTALLED:
        return 0
    make_private_dir(cache_root())
    log = cache_root() / LOG_NAME
    log.write_text("")
    if decision == CACHED:
        wheel = cached_wheel(folder, name, version)
        assert wheel is not None
        print(f"suffix decoding: installing {wheel.name} from the wheel cache {folder}")
    else:
        if shutil.which("cmake") is None and not pip(["install", "-q", "cmake", "ninja"], log):
            raise SystemExit(f"suffix_decoding.py: {name} needs cmake to build and none could be installed; see {log}")
        print(f"suffix decoding: building {name}=={version} from its sdist (once; kept in {folder})")
        wheel = build(name, version, folder, log)
    if not pip(["install", "-q", "--no-deps", "--force-reinstall", str(wheel)], log):
        raise SystemExit(f"suffix_decoding.py: installing {wheel} failed; see {log}")
    if not module_imports():
        raise SystemExit(f"suffix_decoding.py: {wheel.name} is installed but {MODULE} does not import; see {log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
