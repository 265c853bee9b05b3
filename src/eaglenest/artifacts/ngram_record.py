"""The n-gram record: the window and K at which vLLM's n-gram drafting served fastest for one verifier, as the
free_sweep stage measured them, and the rule that picks the n-gram setting a measurement or a server runs.

n-gram drafting (prompt lookup) is the free baseline every draft is judged against, so it runs at its strongest: the
setting a user would serve. The free_sweep stage writes ``metrics/free_sweep.json`` (kept in git)::

    {"verifier": {"name", "fingerprint"},
     "setting": {"prompt_lookup_min": 2, "prompt_lookup_max": 4, "num_speculative_tokens": 4},  # null: not measured
     "serve": {"speedup": 1.21, "speedup_ci95": 0.05, "sets": ["humaneval", ...]},
     "not_measured": null,
     ...}                                # the stage's own details: candidates, simulation, timing, seconds

``fingerprint`` names the verifier the setting was measured on (its weights, :mod:`eaglenest.artifacts.verifier`):
n-gram drafting has no weights of its own, so the setting holds for any draft of that verifier. :func:`measured_ngram`
is the one rule that picks the setting run (evaluate's baseline, ``eaglenest serve --baseline ngram``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.artifacts.sweep_record import read_sweep_record, write_sweep_record
from eaglenest.core.errors import InputFileError
from eaglenest.core.measure.engines import NgramSetting

NGRAM_RECORD_FILE = Path("metrics/free_sweep.json")
MEASURE_HINT = "`dvc repro free_sweep` measures it"


@dataclass(frozen=True)
class NgramFigure:
    """The chosen setting's single-stream speed-up over plain decoding on the turns the stage timed.

    Attributes:
        speedup: n-gram tokens/s over the plain engine's, timed turn by turn beside it, all sets pooled.
        speedup_ci95: Half the 95% interval's width (bootstrap over the paired turns).
        sets: The headline sets timed.
    """

    speedup: float
    speedup_ci95: float
    sets: list[str]


def write_ngram_record(
    path: Path,
    verifier: dict[str, str],
    setting: NgramSetting | None,
    figure: NgramFigure | None,
    details: dict[str, Any],
    not_measured: str | None = None,
) -> dict[str, Any]:
    """Writes the record atomically (``setting`` None: nothing measured, ``not_measured`` says why); returns it.

    Args:
        path: The record's file.
        verifier: The verifier measured on: its ``name`` and ``fingerprint``.
        setting: The setting chosen.
        figure: Its speed-up.
        details: The stage's own details, kept beside (candidates, timing, seconds, host).
        not_measured: Why nothing was measured.
    """
    chosen = (
        None
        if setting is None
        else {
            "prompt_lookup_min": setting.prompt_lookup_min,
            "prompt_lookup_max": setting.prompt_lookup_max,
            "num_speculative_tokens": setting.k,
        }
    )
    serve = None if figure is None else dataclasses.asdict(figure)
    return write_sweep_record(path, {"verifier": verifier, "setting": chosen, "serve": serve}, not_measured, details)


@dataclass(frozen=True)
class NgramRecord:
    """What a record says: the setting and its figure for the verifier ``fingerprint``, or why none was measured."""

    fingerprint: str
    setting: NgramSetting | None
    figure: NgramFigure | None
    not_measured: str | None


def read_ngram_record(path: Path) -> NgramRecord | None:
    """The record at ``path``; None where there is no file.

    Raises:
        InputFileError: the file is not an free_sweep record (one line naming it).
    """
    record = read_sweep_record(path, _parse_ngram_record, "an free_sweep stage record", f"{MEASURE_HINT} again")
    setting = None if record is None else record.setting
    if setting is not None and (not 1 <= setting.prompt_lookup_min <= setting.prompt_lookup_max or setting.k < 1):
        raise InputFileError(
            f"{path}: setting {setting.label} is not one vLLM runs (1 <= prompt_lookup_min <= "
            f"prompt_lookup_max, K >= 1); {MEASURE_HINT} again"
        )
    return record


def _parse_ngram_record(document: dict[str, Any]) -> NgramRecord:
    fingerprint = str(document["verifier"]["fingerprint"])
    chosen, serve = document["setting"], document["serve"]
    setting = (
        None
        if chosen is None
        else NgramSetting(
            int(chosen["prompt_lookup_min"]), int(chosen["prompt_lookup_max"]), int(chosen["num_speculative_tokens"])
        )
    )
    figure = (
        None
        if serve is None
        else NgramFigure(float(serve["speedup"]), float(serve["speedup_ci95"]), [str(s) for s in serve["sets"]])
    )
    return NgramRecord(fingerprint, setting, figure, document.get("not_measured"))


@dataclass(frozen=True)
class NgramChoice:
    """The n-gram setting run and why, in words for the user (``eaglenest serve`` and evaluate's log print it)."""

    setting: NgramSetting
    why: str

    def line(self) -> str:
        return f"n-gram drafting at {self.setting.label} ({self.why})"


def measured_ngram(
    verifier_fingerprint: str, fallback_k: int, record_file: Path | None = NGRAM_RECORD_FILE
) -> NgramChoice:
    """The n-gram setting to run for the verifier ``verifier_fingerprint``: the one the free_sweep stage measured
    fastest for it (``record_file``), else vLLM's default window at K = ``fallback_k`` (what naming the method
    gives).

    Raises:
        InputFileError: a record that is not one (one line).
    """
    fallback = NgramSetting.vllm_default(fallback_k)
    if record_file is None:
        return NgramChoice(fallback, "vLLM's default window")
    record = read_ngram_record(record_file)
    if record is None:
        return NgramChoice(fallback, f"vLLM's default window: no {record_file}; {MEASURE_HINT}")
    if record.fingerprint != verifier_fingerprint:
        return NgramChoice(
            fallback,
            f"vLLM's default window: {record_file} was measured on another verifier; {MEASURE_HINT} for this one",
        )
    if record.setting is None:
        return NgramChoice(fallback, f"vLLM's default window: {record_file} measured none ({record.not_measured})")
    figure = record.figure
    measured = (
        ""
        if figure is None
        else (f": x{figure.speedup:.2f} ± {figure.speedup_ci95:.2f} over plain decoding on {', '.join(figure.sets)}")
    )
    return NgramChoice(record.setting, f"measured fastest by the free_sweep stage{measured}")
