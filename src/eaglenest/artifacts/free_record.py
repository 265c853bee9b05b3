"""The free drafters' record: the settings at which vLLM's n-gram drafting and suffix decoding served fastest for one
verifier, as the free_sweep stage measured them, which of the two was fastest, and the rules that pick the setting a
measurement or a server runs.

The free drafters (n-gram drafting: prompt lookup; suffix decoding: Arctic Inference's suffix trees) are the
baselines every draft is judged against, so they run at their strongest: the settings a user would serve. The
free_sweep stage writes ``metrics/free_sweep.json`` (kept in git)::

    {"verifier": {"name", "fingerprint"},
     "ngram": {"setting": {"prompt_lookup_min": 2, "prompt_lookup_max": 4, "num_speculative_tokens": 4},
               "serve": {"speedup": 1.21, "speedup_ci95": 0.05, "sets": ["humaneval", ...]}},
     "suffix": {"setting": {"max_tree_depth": 24, "max_spec_factor": 1.0, "min_token_prob": 0.1,
                            "num_speculative_tokens": 8},
                "serve": {...}},             # null: not swept (free_sweep.suffix_ks: [])
     "fastest": "suffix",                    # the drafter whose setting served fastest; null: none measured
     "not_measured": null,
     ...}                                    # the stage's own details: candidates, replay, timing, seconds

``fingerprint`` names the verifier the settings were measured on (its weights, :mod:`eaglenest.artifacts.verifier`):
the free drafters have no weights of their own, so the settings hold for any draft of that verifier.
:func:`measured_ngram` and :func:`measured_suffix` are the one rule each that picks the setting run (evaluate's
baselines, ``eaglenest serve --baseline ngram|suffix``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.artifacts.sweep_record import read_sweep_record, write_sweep_record
from eaglenest.core.errors import InputFileError
from eaglenest.core.measure.engines import NgramSetting, SuffixSetting

FREE_RECORD_FILE = Path("metrics/free_sweep.json")
MEASURE_HINT = "`dvc repro free_sweep` measures it"
FREE_DRAFTERS = ("ngram", "suffix")
# vLLM's suffix decoding defaults (suffix_decoding_max_tree_depth, _max_spec_factor, _min_token_prob): what naming
# the method gives, run where no measurement says otherwise.
VLLM_SUFFIX_DEFAULTS = (24, 1.0, 0.1)


@dataclass(frozen=True)
class FreeFigure:
    """A free drafter's chosen setting's single-stream speed-up over plain decoding on the turns the stage timed.

    Attributes:
        speedup: Its tokens/s over the plain engine's, timed turn by turn beside it, all sets pooled.
        speedup_ci95: Half the 95% interval's width (bootstrap over the paired turns).
        sets: The headline sets timed.
    """

    speedup: float
    speedup_ci95: float
    sets: list[str]


def ngram_entry(setting: NgramSetting, figure: FreeFigure) -> dict[str, Any]:
    """The record's ``ngram`` entry."""
    chosen = {
        "prompt_lookup_min": setting.prompt_lookup_min,
        "prompt_lookup_max": setting.prompt_lookup_max,
        "num_speculative_tokens": setting.k,
    }
    return {"setting": chosen, "serve": dataclasses.asdict(figure)}


def suffix_entry(setting: SuffixSetting, figure: FreeFigure) -> dict[str, Any]:
    """The record's ``suffix`` entry."""
    chosen = {
        "max_tree_depth": setting.max_tree_depth,
        "max_spec_factor": setting.max_spec_factor,
        "min_token_prob": setting.min_token_prob,
        "num_speculative_tokens": setting.k,
    }
    return {"setting": chosen, "serve": dataclasses.asdict(figure)}


def write_free_record(
    path: Path,
    verifier: dict[str, str],
    ngram: tuple[NgramSetting, FreeFigure] | None,
    suffix: tuple[SuffixSetting, FreeFigure] | None,
    details: dict[str, Any],
    not_measured: str | None = None,
) -> dict[str, Any]:
    """Writes the record atomically (both None: nothing measured, ``not_measured`` says why); returns it. The
    fastest is the drafter with the larger speed-up (ties: n-gram drafting, the simpler).

    Args:
        path: The record's file.
        verifier: The verifier measured on: its ``name`` and ``fingerprint``.
        ngram: n-gram drafting's chosen setting and its speed-up.
        suffix: Suffix decoding's, where swept.
        details: The stage's own details, kept beside (candidates, timing, seconds, host).
        not_measured: Why nothing was measured.
    """
    figures = {name: entry[1].speedup for name, entry in (("ngram", ngram), ("suffix", suffix)) if entry}
    fastest = max(figures, key=lambda name: (figures[name], name == "ngram")) if figures else None
    chosen = {
        "verifier": verifier,
        "ngram": None if ngram is None else ngram_entry(*ngram),
        "suffix": None if suffix is None else suffix_entry(*suffix),
        "fastest": fastest,
    }
    return write_sweep_record(path, chosen, not_measured, details)


@dataclass(frozen=True)
class FreeRecord:
    """What a record says for the verifier ``fingerprint``: each free drafter's setting and figure (None: not
    measured), the fastest, or why none was measured."""

    fingerprint: str
    ngram: NgramSetting | None
    ngram_figure: FreeFigure | None
    suffix: SuffixSetting | None
    suffix_figure: FreeFigure | None
    fastest: str | None
    not_measured: str | None


def read_free_record(path: Path) -> FreeRecord | None:
    """The record at ``path``; None where there is no file.

    Raises:
        InputFileError: the file is not a free_sweep record (one line naming it).
    """
    record = read_sweep_record(path, _parse_free_record, "a free_sweep stage record", f"{MEASURE_HINT} again")
    setting = None if record is None else record.ngram
    if setting is not None and (not 1 <= setting.prompt_lookup_min <= setting.prompt_lookup_max or setting.k < 1):
        raise InputFileError(
            f"{path}: setting {setting.label} is not one vLLM runs (1 <= prompt_lookup_min <= "
            f"prompt_lookup_max, K >= 1); {MEASURE_HINT} again"
        )
    return record


def _figure(entry: dict[str, Any] | None) -> FreeFigure | None:
    serve = None if entry is None else entry["serve"]
    if serve is None:
        return None
    return FreeFigure(float(serve["speedup"]), float(serve["speedup_ci95"]), [str(s) for s in serve["sets"]])


def _parse_free_record(document: dict[str, Any]) -> FreeRecord:
    fingerprint = str(document["verifier"]["fingerprint"])
    ngram, suffix = document["ngram"], document["suffix"]
    ngram_setting = (
        None
        if ngram is None
        else NgramSetting(
            int(ngram["setting"]["prompt_lookup_min"]),
            int(ngram["setting"]["prompt_lookup_max"]),
            int(ngram["setting"]["num_speculative_tokens"]),
        )
    )
    suffix_setting = (
        None
        if suffix is None
        else SuffixSetting(
            int(suffix["setting"]["max_tree_depth"]),
            float(suffix["setting"]["max_spec_factor"]),
            float(suffix["setting"]["min_token_prob"]),
            int(suffix["setting"]["num_speculative_tokens"]),
        )
    )
    fastest = document["fastest"]
    if fastest is not None and fastest not in FREE_DRAFTERS:
        raise ValueError(f"fastest {fastest!r} is none of {', '.join(FREE_DRAFTERS)}")
    return FreeRecord(
        fingerprint,
        ngram_setting,
        _figure(ngram),
        suffix_setting,
        _figure(suffix),
        fastest,
        document.get("not_measured"),
    )


@dataclass(frozen=True)
class NgramChoice:
    """The n-gram setting run and why, in words for the user (``eaglenest serve`` and evaluate's log print it)."""

    setting: NgramSetting
    why: str

    def line(self) -> str:
        return f"n-gram drafting at {self.setting.label} ({self.why})"


def measured_ngram(
    verifier_fingerprint: str, fallback_k: int, record_file: Path | None = FREE_RECORD_FILE
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
    record = read_free_record(record_file)
    if record is None:
        return NgramChoice(fallback, f"vLLM's default window: no {record_file}; {MEASURE_HINT}")
    if record.fingerprint != verifier_fingerprint:
        return NgramChoice(
            fallback,
            f"vLLM's default window: {record_file} was measured on another verifier; {MEASURE_HINT} for this one",
        )
    if record.ngram is None:
        return NgramChoice(fallback, f"vLLM's default window: {record_file} measured none ({record.not_measured})")
    return NgramChoice(record.ngram, f"measured fastest by the free_sweep stage{_measured(record.ngram_figure)}")


def _measured(figure: FreeFigure | None) -> str:
    if figure is None:
        return ""
    return f": x{figure.speedup:.2f} ± {figure.speedup_ci95:.2f} over plain decoding on {', '.join(figure.sets)}"


@dataclass(frozen=True)
class SuffixChoice:
    """The suffix decoding setting run and why, in words for the user."""

    setting: SuffixSetting
    why: str

    def line(self) -> str:
        return f"suffix decoding at {self.setting.label} ({self.why})"


def measured_suffix(
    verifier_fingerprint: str, fallback_k: int, record_file: Path | None = FREE_RECORD_FILE
) -> SuffixChoice:
    """The suffix decoding setting to run for the verifier ``verifier_fingerprint``: the one the free_sweep stage
    measured fastest for it (``record_file``), else vLLM's defaults at K = ``fallback_k``.

    Raises:
        InputFileError: a record that is not one (one line).
    """
    fallback = SuffixSetting(*VLLM_SUFFIX_DEFAULTS, fallback_k)
    if record_file is None:
        return SuffixChoice(fallback, "vLLM's defaults")
    record = read_free_record(record_file)
    if record is None:
        return SuffixChoice(fallback, f"vLLM's defaults: no {record_file}; {MEASURE_HINT}")
    if record.fingerprint != verifier_fingerprint:
        return SuffixChoice(
            fallback, f"vLLM's defaults: {record_file} was measured on another verifier; {MEASURE_HINT} for this one"
        )
    if record.suffix is None:
        why = record.not_measured or "free_sweep.suffix_ks is []"
        return SuffixChoice(fallback, f"vLLM's defaults: {record_file} measured none ({why})")
    return SuffixChoice(record.suffix, f"measured fastest by the free_sweep stage{_measured(record.suffix_figure)}")
