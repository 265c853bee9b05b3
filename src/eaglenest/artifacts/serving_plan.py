"""The serving plan: what to serve for one draft, chosen from what evaluate timed, in one record that ``eaglenest
serve`` reads (``metrics/serving_plan.json``, written by the plan stage, kept in git)::

    {"draft_sha256": "...",                 # the draft it was chosen for: another draft is served without it
     "method": "hybrid",                    # plain | ngram | suffix | draft | hybrid
     "why": "...",                          # the rule's words: fastest, and which cheaper one's interval reaches it
     "pooled": {method: {"value", "low", "high"}},  # single-stream speed-up over plain, headline sets pooled
     "sets": [...], "draft": {"k", "why"}, "hybrid": {...} | null, "free": {"ngram": {...}, "suffix": {...}},
     "schedule": null, "schedule_why": "..."}

The rule (:func:`choose_method`): the method with the best pooled speed-up is the fastest; the one served is the
cheapest whose 95% interval reaches the fastest's (:data:`METHODS`, cheapest first: plain decoding costs nothing,
a free drafter a lookup, the draft a forward per step, the hybrid a forward and a suffix tree). So where timing
cannot tell two apart the cheaper stands, and the same draft does not flip between runs on noise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglenest.core.atomic import atomic_write_json
from eaglenest.core.errors import InputFileError
from eaglenest.core.json_file import read_json

PLAN_FILE = Path("metrics/serving_plan.json")
METHODS = ("plain", "ngram", "suffix", "draft", "hybrid")  # cheapest first


def choose_method(pooled: dict[str, tuple[float, float, float]]) -> tuple[str, str]:
    """The method to serve from each measured method's pooled speed-up ``(value, low, high)`` (plain decoding is
    ``(1, 1, 1)`` where absent), and why, in words."""
    figures = {"plain": (1.0, 1.0, 1.0), **pooled}
    measured = [method for method in METHODS if method in figures]
    fastest = max(measured, key=lambda m: (figures[m][0], -measured.index(m)))
    value, low, _ = figures[fastest]
    chosen = next(m for m in measured if figures[m][2] >= low)
    said = f"{fastest} was fastest (x{value:.3f}, 95% {low:.3f}–{figures[fastest][2]:.3f})"
    if chosen == fastest:
        return chosen, f"{said}; no cheaper method's interval reaches it"
    return chosen, (
        f"{said}, and {chosen}'s interval (x{figures[chosen][0]:.3f}, up to {figures[chosen][2]:.3f}) reaches it: "
        "the cheaper method stands"
    )


def write_serving_plan(path: Path, plan: dict[str, Any]) -> None:
    """Writes the plan (atomically: serve trusts what exists)."""
    atomic_write_json(path, plan)


def planned_method(draft_sha256: str, path: Path = PLAN_FILE) -> tuple[str | None, str]:
    """The method the plan at ``path`` serves for the draft of ``draft_sha256``, and why; None where there is no
    plan, or it was made for another draft (why says which).

    Raises:
        InputFileError: the file is not a serving plan (one line naming it).
    """
    if not path.is_file():
        return None, f"no {path}; `dvc repro plan` makes one"
    plan = read_json(path, f"{path}: no such file", "`dvc repro plan` writes it again")
    method = plan.get("method") if isinstance(plan, dict) else None
    if method not in METHODS or not isinstance(plan.get("draft_sha256"), str):  # type: ignore[union-attr]
        raise InputFileError(f"{path}: not a serving plan (method {method!r}); `dvc repro plan` writes it again")
    if plan["draft_sha256"] != draft_sha256:
        return None, f"{path} was made for another draft; `dvc repro plan` makes one for this one"
    return str(method), str(plan.get("why", ""))
