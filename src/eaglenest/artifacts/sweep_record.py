"""What the sweep stages' records (:mod:`eaglenest.artifacts.k_record`, :mod:`eaglenest.artifacts.free_record`)
share: one JSON file, kept in git, that says what was measured on, the setting chosen with its speed-up (or why
nothing was measured) and the stage's own details; written atomically, read back or refused with one line."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from eaglenest.core.atomic import atomic_write_json
from eaglenest.core.errors import InputFileError

R = TypeVar("R")


def write_sweep_record(
    path: Path, chosen: dict[str, Any], not_measured: str | None, details: dict[str, Any]
) -> dict[str, Any]:
    """Writes the record atomically; returns it.

    Args:
        path: The record's file.
        chosen: The record's own fields, first: what was measured on, the setting chosen and its figure.
        not_measured: Why nothing was measured (None where something was).
        details: The stage's own details, kept after.
    """
    record = {**chosen, "not_measured": not_measured, **details}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, record)
    return record


def read_sweep_record(path: Path, parse: Callable[[dict[str, Any]], R], not_one: str, fix: str) -> R | None:
    """The record at ``path`` as ``parse`` reads the document; None where there is no file.

    Args:
        path: The record's file.
        parse: Reads the document; a missing key or a value of the wrong type raises.
        not_one: What the file is not, for the message ("a k_sweep stage record").
        fix: What the user does about it.

    Raises:
        InputFileError: the file is not readable JSON, or ``parse`` refuses it (one line naming it).
    """
    if not path.is_file():
        return None
    try:
        return parse(json.loads(path.read_text()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise InputFileError(f"{path}: not {not_one} ({type(err).__name__}: {err}); {fix}") from None
