"""What the setup scripts (cpu_torch.py, suffix_decoding.py) share: the Makefile's exact pins, and what the venv
holds. Standard library only: they run in a venv that may hold nothing but pip."""

from __future__ import annotations

from importlib import metadata


def parse_pin(text: str, script: str, variable: str) -> tuple[str, str]:
    """``name==version`` as ``(name, version)``; anything else stops with one line naming ``script`` and the
    Makefile's ``variable``."""
    name, sep, version = text.partition("==")
    if not sep or not name or not version or any(c in version for c in "<>=!~*, "):
        raise SystemExit(f"{script}: {text!r} is not an exact pin NAME==VERSION (the Makefile's {variable})")
    return name, version


def installed_version(name: str) -> str | None:
    """The version of ``name`` in this interpreter's environment, or None."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
