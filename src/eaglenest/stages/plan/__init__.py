"""The plan stage: what to serve for the trained draft, from what evaluate timed, in one record ``eaglenest serve``
reads (``metrics/serving_plan.json``, :mod:`eaglenest.artifacts.serving_plan`).

Each method evaluate timed (plain decoding, n-gram drafting, suffix decoding, the draft, the hybrid) gets its
single-stream speed-up over plain decoding on every headline set's timed turns pooled, with its 95% interval over
conversations (the measurement kit's paired statistic, :func:`eaglenest.artifacts.evaluation.speedup_interval`).
The cheapest method whose interval reaches the fastest's is served (:func:`choose_method`). Beside it the plan keeps
what serving it needs: the draft's K (the k_sweep stage's, :func:`eaglenest.artifacts.k_record.served_k`), the
hybrid's setting and the free drafters' as evaluate ran them, and the K schedule (none measured here yet: every
batch size at the method's K). Pure arithmetic over evaluate's records: seconds, no engine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.artifacts.draft_hash import draft_fingerprint
from eaglenest.artifacts.evaluation import DETAILS_FILE, load_records, records_path, speedup_interval
from eaglenest.artifacts.k_record import served_k
from eaglenest.artifacts.metrics_file import read_metrics
from eaglenest.artifacts.serving_plan import choose_method, write_serving_plan
from eaglenest.core.stage import Stage, path_arg
from eaglenest.stages.plan.params import PlanStageParams

log = logging.getLogger(__name__)

BACKEND = "vllm"  # the back end whose engines a server runs
# evaluate's name for each method's timed figures (records' ``<name>_s``)
TIMED_AS = {"ngram": "ngram", "suffix": "suffix", "draft": "spec", "hybrid": "hybrid"}


@dataclass(frozen=True)
class PlanPaths:
    """Where dvc.yaml puts the plan stage's inputs and output."""

    draft: Path = path_arg("the train stage's draft checkpoint (its sha256 keys the plan)")
    eval: Path = path_arg("evaluate's records and details (metrics/eval)")
    k_sweep: Path = path_arg("the k_sweep stage's record: the draft's K (metrics/k_sweep.json)")
    out: Path = path_arg("the serving plan (metrics/serving_plan.json)")


def pooled_speedups(
    records_doc: dict[str, Any], headline_sets: list[str], samples: int, seed: int
) -> dict[str, tuple[float, float, float]]:
    """Each method's single-stream speed-up over plain decoding on the headline sets' timed turns pooled, as
    ``(value, low, high)``; methods evaluate did not time are left out. A conversation of one set is never
    another's: ids are prefixed with the set."""
    sets = records_doc["runs"].get(BACKEND, {}).get("sets", {})
    pooled = [
        record | {"id": f"{name}/{record['id']}"}
        for name in headline_sets
        for record in sets.get(name, {}).get("records", [])
    ]
    figures = {}
    for method, timed_as in TIMED_AS.items():
        interval = speedup_interval(pooled, samples, seed, timed_as)
        if interval is not None:
            figures[method] = (round(interval.value, 4), round(interval.low, 4), round(interval.high, 4))
    return figures


def plan(params: PlanStageParams, paths: PlanPaths) -> dict[str, Any]:
    """The plan stage."""
    evaluate = params.evaluate
    headline = [s.name for s in evaluate.sets if s.headline]
    records_doc = load_records(records_path(paths.eval).read_text(), str(records_path(paths.eval)))
    details = read_metrics(paths.eval / DETAILS_FILE)
    run = details.get("runs", {}).get(BACKEND, {})
    pooled = pooled_speedups(records_doc, headline, evaluate.bootstrap_samples, evaluate.seed)
    if pooled:
        method, why = choose_method(pooled)
    else:  # nothing a server runs was timed (evaluate ran no vllm back end, or no timed turns)
        method, why = "draft", "evaluate timed no method a vLLM server runs (no vllm back end or no timed turns)"
    k = served_k(paths.draft, None, paths.k_sweep)
    first = next(iter(run.get("sets", {}).values()), {})
    document = {
        "draft_sha256": draft_fingerprint(paths.draft),
        "method": method,
        "why": why,
        "sets": headline,
        "pooled": {m: {"value": v, "low": lo, "high": hi} for m, (v, lo, hi) in pooled.items()},
        "draft": {"k": k.k, "why": k.why},
        "hybrid": (run.get("hybrid") or {}).get("setting"),
        "free": {drafter: first.get(drafter) for drafter in ("ngram", "suffix")},
        "schedule": None,
        "schedule_why": "no served-load sweep in the pipeline yet: every batch size at the method's K",
    }
    write_serving_plan(paths.out, document)
    log.info("serve %s: %s", method, why)
    return {"method": method}


STAGE = Stage(
    "plan",
    "What to serve for the trained draft (plain, n-gram, suffix, the draft or the hybrid), from evaluate's timed "
    "turns: the record eaglenest serve reads.",
    PlanStageParams,
    PlanPaths,
    plan,
)
