"""The K record: the K the k_sweep stage measured fastest for one draft, and the rule that picks the K served.

K is the drafts per verify step. A draft has its own K (``speculative_tokens`` in its config, ``train.ttt_steps``:
:func:`eaglenest.artifacts.draft.draft_tokens`); the k_sweep stage times it at other Ks and writes
``metrics/k_sweep.json`` (kept in git)::

    {"draft": {"path", "sha256", "algorithm", "trained_k"},
     "serve_k": 2,                      # null where nothing was measured ("not_measured" says why)
     "serve": {"k": 2, "speedup": 1.31, "speedup_ci95": 0.12, "sets": ["humaneval", ...]},
     "not_measured": null,
     ...}                               # the stage's own details: Ks, rounds, per set and K, seconds

``sha256`` (:func:`eaglenest.artifacts.draft_hash.draft_fingerprint`) names the draft the K was measured on: a
retrained draft has another, and is served at its own K until the stage runs for it. :func:`served_k` is the one rule
that picks the K served (``eaglenest serve``, ``eaglenest bench --serve``, ``eaglenest summary``); a K told outright
follows the measurement kit's rule (:func:`eaglenest.core.measure.engines.requested_k`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.artifacts.draft_hash import draft_fingerprint
from eaglenest.artifacts.sweep_record import read_sweep_record, write_sweep_record
from eaglenest.core.errors import InputFileError
from eaglenest.core.measure.engines import requested_k

K_RECORD_FILE = Path("metrics/k_sweep.json")
MEASURE_HINT = "`dvc repro k_sweep` measures it"


@dataclass(frozen=True)
class ServedFigure:
    """The speed-up at the K to serve, over the headline sets' timed turns.

    Attributes:
        k: The K.
        speedup: The draft's tokens/s over the plain engine's, timed turn by turn beside it, all sets pooled.
        speedup_ci95: Half the 95% interval's width (bootstrap over the paired turns).
        sets: The headline sets timed.
    """

    k: int
    speedup: float
    speedup_ci95: float
    sets: list[str]


def write_k_record(
    path: Path,
    draft_dir: Path,
    algorithm: str,
    trained_k: int,
    served: ServedFigure | None,
    details: dict[str, Any],
    not_measured: str | None = None,
) -> dict[str, Any]:
    """Writes the record atomically (``served`` None: nothing measured, ``not_measured`` says why); returns it."""
    draft = {
        "path": str(draft_dir),
        "sha256": draft_fingerprint(draft_dir),
        "algorithm": algorithm,
        "trained_k": trained_k,
    }
    serve = None if served is None else dataclasses.asdict(served)
    return write_sweep_record(
        path, {"draft": draft, "serve_k": served.k if served else None, "serve": serve}, not_measured, details
    )


@dataclass(frozen=True)
class KRecord:
    """What a record says about serving: the K and its figure for the draft ``sha256``, or why none was measured."""

    sha256: str
    served: ServedFigure | None
    not_measured: str | None


def read_k_record(path: Path) -> KRecord | None:
    """The record at ``path``; None where there is no file.

    Raises:
        InputFileError: the file is not a k_sweep record (one line naming it).
    """
    record = read_sweep_record(
        path, _parse_k_record, "a k_sweep stage record", f"{MEASURE_HINT} again, or pass --num-speculative-tokens K"
    )
    if record is not None and record.served is not None and record.served.k < 1:
        raise InputFileError(f"{path}: serve.k is {record.served.k}; {MEASURE_HINT} again")
    return record


def _parse_k_record(document: dict[str, Any]) -> KRecord:
    sha256 = str(document["draft"]["sha256"])
    serve = document["serve"]
    served = (
        None
        if serve is None
        else ServedFigure(
            int(serve["k"]), float(serve["speedup"]), float(serve["speedup_ci95"]), [str(s) for s in serve["sets"]]
        )
    )
    return KRecord(sha256, served, document.get("not_measured"))


@dataclass(frozen=True)
class KChoice:
    """The K served and why, in words for the user (``eaglenest serve`` and ``eaglenest summary`` print it)."""

    k: int
    why: str

    def line(self) -> str:
        return f"served K: {self.k} ({self.why})"


def served_k(
    draft_dir: Path,
    told: int | None = None,
    record_file: Path | None = K_RECORD_FILE,
    told_name: str = "--num-speculative-tokens",
) -> KChoice:
    """The K to serve the draft at: ``told`` where given, else the K the k_sweep stage measured fastest for this
    very draft (``record_file``), else the draft's own.

    Raises:
        EaglenestError: ``told`` below 1, a draft that is not a checkpoint vLLM serves, or a record that is not
            one (one line each).
    """
    from eaglenest.artifacts.draft import draft_tokens  # imports torch: not at the top, which commands read

    own = draft_tokens(draft_dir, "--draft")
    if told is not None:
        return KChoice(requested_k(told, own, told_name), told_name)
    if record_file is None:
        return KChoice(own, "the draft's own")
    record = read_k_record(record_file)
    if record is None:
        return KChoice(own, f"the draft's own: no {record_file}; {MEASURE_HINT}")
    if record.sha256 != draft_fingerprint(draft_dir):
        return KChoice(
            own, f"the draft's own: {record_file} was measured on another draft; {MEASURE_HINT} for this one"
        )
    if record.served is None:
        return KChoice(own, f"the draft's own: {record_file} measured no K ({record.not_measured})")
    figure = record.served
    return KChoice(
        figure.k,
        f"measured for this draft by the k_sweep stage: x{figure.speedup:.2f} ± "
        f"{figure.speedup_ci95:.2f} on {', '.join(figure.sets)}",
    )
