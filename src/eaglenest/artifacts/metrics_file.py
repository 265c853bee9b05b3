"""The declared metrics files as the commands read them (``metrics/eval.json``, ``metrics/train.json``, details):
read with one line naming a file that is missing or not JSON, and a figure printed with its 95% interval. Imports
nothing heavy: the command line reads it at start."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eaglenest.core.errors import InputFileError


def read_metrics(path: Path) -> dict[str, Any]:
    """A metrics file (``metrics/eval.json``, ``metrics/train.json``, details), or one line naming the file and what
    is wrong with it."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise InputFileError(f"{path}: not found; run the pipeline first (dvc repro)") from None
    except json.JSONDecodeError as err:
        raise InputFileError(f"{path}: not valid JSON: {err.msg}") from None


def interval_text(value: float | None, half_width: float | None, prefix: str = "") -> str:
    """A figure as the tables print it: ``x1.234 ± 0.056``; "—" where there is none."""
    if value is None:
        return "—"
    return f"{prefix}{value:.3f} ± {half_width:.3f}" if half_width is not None else f"{prefix}{value:.3f}"


def figure_text(figures: dict[str, Any], key: str, prefix: str = "") -> str:
    """``figures[key]`` with its ``_ci95`` half-width where the metrics hold one (:func:`interval_text`)."""
    return interval_text(figures.get(key), figures.get(f"{key}_ci95"), prefix)


def summary_figure_text(summary: dict[str, Any], key: str, prefix: str = "") -> str:
    """A set's figure from its summary in ``metrics/eval/details.json`` (``{"value": ..., "ci95": ...}``) as the
    tables print it; "—" where the summary has none."""
    entry = summary.get(key) or {}
    return interval_text(entry.get("value"), entry.get("ci95"), prefix)


def versus_text(figures: dict[str, Any], backend: str, summary: dict[str, Any]) -> str:
    """The verdict of one set, as the tables print it: the draft's speed over the fastest free drafter's with its 95%
    half-width (``metrics/eval.json``) and the word the interval gives (``ahead``, ``tie``, ``behind``: the set's
    summary in ``metrics/eval/details.json``, whose interval is the asymmetric one)."""
    versus = summary.get("vs_free") or {}
    said = versus.get("verdict")
    text = figure_text(figures, f"{backend}_vs_free", "x")
    if said and text != "—" and versus.get("drafter"):
        return f"{text} {said} ({versus['drafter']})"
    return f"{text} {said}" if said and text != "—" else text
