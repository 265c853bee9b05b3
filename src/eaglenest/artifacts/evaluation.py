"""What the evaluate stage hands on: per-prompt records, their summaries and the headline figures.

``metrics/eval/records.json`` keeps one record per decoded turn, per back end and set, so that figures can
be recomputed, resampled and paired between revisions (``eaglenest report BASE HEAD``)::

    {"num_speculative_tokens": K,
     "runs": {backend: {"dtype": ..., "sets": {set: {"temperature", "max_new_tokens", "source",
                                                    "ngram", "records": [record, ...]}}}}}

``ngram`` (vllm) is the n-gram baseline's setting: its lookup ``window``, its ``num_speculative_tokens`` and why
(the free_sweep stage's measurement, or vLLM's default where there is none); ``suffix`` (vllm) suffix decoding's
(tree depth, spec factor, least token probability, K, why); ``free_drafter`` the one of the two the free_sweep stage
measured fastest, the baseline the verdict is against (``ngram`` where nothing was measured).

A record (one prompt turn):

* ``id``, ``turn`` (1-based), ``category`` — which prompt; ``(id, turn)`` pairs revisions;
* ``steps``, ``accepted``, ``drafted``, ``per_position`` — the draft's acceptance counts on this turn;
* ``identical``, ``lossless`` — against plain decoding of the same engine (see the evaluate stage);
* ``plain_tokens``/``plain_s``, ``spec_tokens``/``spec_s`` — the turn decoded alone (single stream), where it
  was timed, else null; ``ngram_tokens``/``ngram_s`` and ``suffix_tokens``/``suffix_s`` the same for the free
  drafters (vllm);
* ``alone_steps``, ``alone_accepted`` — vllm, timed turns: the draft's counts when the turn was decoded alone,
  beside ``steps``/``accepted`` from the batched pass (batching changes the numerics, and with them acceptance);
* ``ngram_steps``, ``ngram_accepted``, ``ngram_drafted``, ``ngram_per_position`` — the n-gram baseline's counts
  (at its own K): vLLM's own on the timed turns (it counts only steps where the lookup proposed, so its tau is
  conditional on a match) or, for hf, replayed on the plain output; absent where not measured;
* ``suffix_steps``, ``suffix_accepted``, ``suffix_drafted``, ``suffix_per_position`` — suffix decoding's (vllm, the
  timed turns; its steps too are those where it proposed).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from eaglenest.artifacts.free_record import FREE_DRAFTERS
from eaglenest.artifacts.metrics_file import read_metrics
from eaglenest.core.bootstrap import Interval, bootstrap, tau_statistic
from eaglenest.core.drafter.config import DrafterConfig
from eaglenest.core.errors import InputFileError
from eaglenest.core.measure.speedup import speedup_interval as paired_speedup

RECORDS_FILE = "records.json"
DETAILS_FILE = "details.json"


def cluster_sums(records: list[dict[str, Any]], fields: tuple[str, ...]) -> np.ndarray:
    """``[conversations, len(fields)]``: the fields summed over each conversation's turns (turns of one
    conversation are resampled together: they share context)."""
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(fields))
    for record in records:
        row = sums[str(record["id"])]
        for i, name in enumerate(fields):
            row[i] += float(record[name])
    return np.array(list(sums.values()), dtype=np.float64).reshape(-1, len(fields))


def tau_interval(records: list[dict[str, Any]], samples: int, seed: int, prefix: str = "") -> Interval:
    """tau = 1 + accepted / steps over the records, with its bootstrap interval over conversations."""
    return bootstrap(cluster_sums(records, (f"{prefix}accepted", f"{prefix}steps")), tau_statistic, samples, seed)


def timed(records: list[dict[str, Any]], drafter: str = "spec") -> list[dict[str, Any]]:
    """The records decoded alone for timing (``drafter``: spec or ngram)."""
    return [r for r in records if r.get(f"{drafter}_s") is not None and r.get("plain_s") is not None]


def speedup_interval(records: list[dict[str, Any]], samples: int, seed: int, drafter: str = "spec") -> Interval | None:
    """Single-stream tokens/s of ``drafter`` over plain decoding on the timed records, the measurement kit's speed-up
    with its interval over conversations; None if none was timed."""
    chosen = timed(records, drafter)
    if not chosen:
        return None
    fields = (f"{drafter}_tokens", f"{drafter}_s", "plain_tokens", "plain_s")
    return paired_speedup(cluster_sums(chosen, fields), samples, seed)


def draft_vs_free(
    records: list[dict[str, Any]], samples: int, seed: int, free: str = "ngram", drafter: str = "spec"
) -> Interval | None:
    """``drafter``'s (the draft, ``spec``, or the ``hybrid``) single-stream tokens/s over the free drafter ``free``'s
    (``ngram``, ``suffix``; or the draft, ``spec``) on the turns both decoded alone, paired conversation by
    conversation (the measurement kit's speed-up statistic with the free drafter in plain's place), with its 95%
    interval; None where either was not timed.

    A ratio of the two speed-ups would carry both engines' spread against plain decoding; pairing the draft with
    the free drafter directly cancels what the two share on each prompt (its length, what the machine was doing)."""
    chosen = [r for r in timed(records, drafter) if r.get(f"{free}_s") is not None]
    if not chosen:
        return None
    fields = (f"{drafter}_tokens", f"{drafter}_s", f"{free}_tokens", f"{free}_s")
    return paired_speedup(cluster_sums(chosen, fields), samples, seed)


def verdict(versus: Interval) -> str:
    """``ahead``, ``behind`` or ``tie``: whether the 95% interval of the draft's speed over n-gram's lies wholly
    above 1, wholly below it, or around it."""
    if versus.low > 1:
        return "ahead"
    if versus.high < 1:
        return "behind"
    return "tie"


def summarize(records: list[dict[str, Any]], k: int, samples: int, seed: int, free: str = "ngram") -> dict[str, Any]:
    """One back end's figures on one set: tau and speed-up with intervals, acceptance per position, the free
    drafters (each one's tau and speed-up, the draft's speed over each, and ``vs_free``: over ``free``, the one the
    free_sweep stage measured fastest), lossless counts and tau per category."""
    steps = sum(r["steps"] for r in records)
    per_position = [sum(r["per_position"][i] for r in records) for i in range(k)]
    drafted = sum(r["drafted"] for r in records)
    summary: dict[str, Any] = {
        "tau": tau_interval(records, samples, seed).as_dict(),
        "per_position_acceptance": [round(c / steps, 4) if steps else 0.0 for c in per_position],
        "draft_acceptance_rate": round(sum(r["accepted"] for r in records) / drafted, 4) if drafted else 0.0,
        "verify_steps": steps,
        "num_prompts": len({str(r["id"]) for r in records}),
        "num_turns": len(records),
        "identical_fraction": round(sum(bool(r["identical"]) for r in records) / len(records), 4),
        "lossless_fraction": round(sum(bool(r["lossless"]) for r in records) / len(records), 4),
    }
    for drafter in FREE_DRAFTERS:
        if sum(r.get(f"{drafter}_steps") or 0 for r in records):
            # vllm decodes the free drafters on the timed turns only: their counts are theirs
            measured = [r for r in records if r.get(f"{drafter}_steps") is not None]
            summary[f"{drafter}_tau"] = tau_interval(measured, samples, seed, prefix=f"{drafter}_").as_dict()
            summary[f"{drafter}_per_position_acceptance"] = _free_per_position(measured, drafter)
    for drafter, name in (("spec", "speedup"), *((d, f"{d}_speedup") for d in (*FREE_DRAFTERS, "hybrid"))):
        interval = speedup_interval(records, samples, seed, drafter)
        if interval is not None:
            chosen = timed(records, drafter)
            summary[name] = interval.as_dict()
            summary[f"tokens_per_s_{drafter}"] = round(
                sum(r[f"{drafter}_tokens"] for r in chosen) / sum(r[f"{drafter}_s"] for r in chosen), 2
            )
            summary["tokens_per_s_plain"] = round(
                sum(r["plain_tokens"] for r in chosen) / sum(r["plain_s"] for r in chosen), 2
            )
            summary["timed_turns"] = len(chosen)
    for drafter in FREE_DRAFTERS:
        versus = draft_vs_free(records, samples, seed, drafter)
        if versus is not None:
            summary[f"vs_{drafter}"] = versus.as_dict() | {"verdict": verdict(versus)}
    if f"vs_{free}" in summary:
        summary["vs_free"] = summary[f"vs_{free}"] | {"drafter": free}
    summary.update(_hybrid_summary(records, samples, seed, free))
    alone = [r for r in records if r.get("alone_steps") is not None]
    if alone:
        # the same turns' tau decoded together and decoded alone; alone is the tau the timed speed-ups decoded at
        summary["tau_batched_vs_alone"] = {
            "batched": tau_interval(alone, samples, seed).as_dict(),
            "alone": bootstrap(
                cluster_sums(alone, ("alone_accepted", "alone_steps")), tau_statistic, samples, seed
            ).as_dict(),
        }
    categories = sorted({r["category"] for r in records if r.get("category")})
    if categories:
        summary["categories"] = {
            category: tau_interval([r for r in records if r.get("category") == category], samples, seed).as_dict()
            for category in categories
        }
    return summary


def _hybrid_summary(records: list[dict[str, Any]], samples: int, seed: int, free: str) -> dict[str, Any]:
    """The hybrid's figures on a set it decoded (greedy sets): tau, lossless and identical fractions over the batched
    pass, whether each timed turn decoded alone emitted plain's tokens decoded alone, and its speed over the free
    drafter ``free`` (``hybrid_vs_free``) and over the draft alone (``hybrid_vs_spec``), paired."""
    decoded = [r for r in records if r.get("hybrid_steps") is not None]
    if not decoded:
        return {}
    summary: dict[str, Any] = {
        "hybrid_tau": tau_interval(decoded, samples, seed, prefix="hybrid_").as_dict(),
        "hybrid_identical_fraction": round(sum(bool(r["hybrid_identical"]) for r in decoded) / len(decoded), 4),
        "hybrid_lossless_fraction": round(sum(bool(r["hybrid_lossless"]) for r in decoded) / len(decoded), 4),
    }
    alone = [r for r in decoded if r.get("hybrid_timed_identical") is not None]
    if alone:
        summary["hybrid_timed_identical_fraction"] = round(
            sum(bool(r["hybrid_timed_identical"]) for r in alone) / len(alone), 4
        )
    for baseline, name in ((free, "hybrid_vs_free"), ("spec", "hybrid_vs_spec")):
        versus = draft_vs_free(records, samples, seed, baseline, drafter="hybrid")
        if versus is not None:
            summary[name] = versus.as_dict() | {"verdict": verdict(versus), "drafter": baseline}
    return summary


def _free_per_position(records: list[dict[str, Any]], drafter: str) -> list[float]:
    """A free drafter's acceptance per draft position, at its own K (the free_sweep stage's, not the draft's)."""
    steps = sum(r.get(f"{drafter}_steps") or 0 for r in records)
    k = max(len(r.get(f"{drafter}_per_position") or []) for r in records)
    counts = [sum((r.get(f"{drafter}_per_position") or [0] * k)[i] for r in records) for i in range(k)]
    return [round(c / steps, 4) if steps else 0.0 for c in counts]


def headline(details: dict[str, Any], headline_sets: list[str], backend: str) -> dict[str, Any]:
    """The figures ``metrics/eval.json`` holds: per headline set, the serving back end's tau and speed-up (each with
    its 95% half-width), tau on the timed turns as they were decoded (``_tau_timed``, beside tau on the whole set),
    the verdict's figure (``_vs_free``: the draft's speed over the fastest free drafter's, paired, with its
    half-width; ``_free`` names that drafter), each free drafter's and the hybrid's speed-up over plain decoding
    (``_ngram_speedup``, ``_suffix_speedup``, ``_hybrid_speedup``: their intervals are in details.json), and the
    hybrid's speed over the fastest free drafter, paired (``_hybrid_vs_free``, with its half-width): at most a dozen
    numbers per headline set; ``lossless``, the smallest lossless
    fraction of any greedy set, back end and drafter (the hybrid's included). The rest (the draft over each free
    drafter, the hybrid over the draft, taus per drafter) stays in the set's summary (``metrics/eval/details.json``)."""
    figures: dict[str, Any] = {}
    for name in headline_sets:
        summary = details["runs"][backend]["sets"][name]["summary"]
        entry = {f"{backend}_tau": summary["tau"]["value"], f"{backend}_tau_ci95": summary["tau"]["ci95"]}
        if "speedup" in summary:
            entry[f"{backend}_speedup"] = summary["speedup"]["value"]
            entry[f"{backend}_speedup_ci95"] = summary["speedup"]["ci95"]
        if "vs_free" in summary:
            entry[f"{backend}_vs_free"] = summary["vs_free"]["value"]
            entry[f"{backend}_vs_free_ci95"] = summary["vs_free"]["ci95"]
            entry[f"{backend}_free"] = summary["vs_free"]["drafter"]
        if "tau_batched_vs_alone" in summary:
            entry[f"{backend}_tau_timed"] = summary["tau_batched_vs_alone"]["alone"]["value"]
        # the other drafters' speed-ups as bare figures (their intervals are in details.json), so that `dvc metrics
        # show` stays at a dozen numbers per set; the hybrid's verdict with its interval
        for figure in (*(f"{d}_speedup" for d in FREE_DRAFTERS), "hybrid_speedup"):
            if figure in summary:
                entry[f"{backend}_{figure}"] = summary[figure]["value"]
        if "hybrid_vs_free" in summary:
            entry[f"{backend}_hybrid_vs_free"] = summary["hybrid_vs_free"]["value"]
            entry[f"{backend}_hybrid_vs_free_ci95"] = summary["hybrid_vs_free"]["ci95"]
        figures[name] = entry
    greedy = [
        fraction
        for run in details["runs"].values()
        for s in run["sets"].values()
        if s["temperature"] == 0
        for fraction in (s["summary"]["lossless_fraction"], s["summary"].get("hybrid_lossless_fraction", 1.0))
    ]
    if greedy:
        figures["lossless"] = min(greedy)
    return figures


def load_records(text: str, where: str) -> dict[str, Any]:
    """A records.json document, checked for the fields the report reads.

    Raises:
        InputFileError: naming ``where`` and the first missing field.
    """
    try:
        document = json.loads(text)
    except json.JSONDecodeError as err:
        raise InputFileError(f"{where}: not valid JSON: {err.msg}") from None
    runs = document.get("runs") if isinstance(document, dict) else None
    if not isinstance(runs, dict) or not isinstance(document.get("num_speculative_tokens"), int):
        raise InputFileError(f"{where}: expected {{'num_speculative_tokens': K, 'runs': {{backend: ...}}}}")
    for backend, run in runs.items():
        for set_name, entry in (run.get("sets") or {}).items():
            for record in entry.get("records", []):
                missing = [f for f in ("id", "turn", "steps", "accepted") if f not in record]
                if missing:
                    raise InputFileError(f"{where}: runs.{backend}.sets.{set_name}: a record lacks {missing[0]!r}")
    return document


def records_path(eval_dir: Path) -> Path:
    return eval_dir / RECORDS_FILE


def measured_hybrid(details_path: Path, draft_dir: Path) -> tuple[DrafterConfig, str]:
    """The hybrid evaluate measured for the draft in ``draft_dir`` (``runs.vllm.hybrid`` of ``details_path``,
    ``metrics/eval/details.json``): its setting, and why it is that setting.

    Raises:
        InputFileError: no such file, no hybrid measured there (with evaluate's reason), or one measured on another
            draft (its sha256 differs): one line naming the file.
    """
    from eaglenest.artifacts.draft_hash import draft_fingerprint

    details = read_metrics(details_path)
    record = (details.get("runs", {}).get("vllm", {}) or {}).get("hybrid") or {}
    if not record.get("measured"):
        why = record.get("why", "the vllm back end did not run")
        raise InputFileError(f"{details_path}: evaluate measured no hybrid ({why}); serve the draft alone")
    sha256 = draft_fingerprint(draft_dir)
    if record.get("draft_sha256") != sha256:
        raise InputFileError(
            f"{details_path}: the hybrid was measured on another draft (sha256 {str(record.get('draft_sha256'))[:12]}, "
            f"{draft_dir} is {sha256[:12]}); run evaluate on this draft (dvc repro evaluate)"
        )
    return DrafterConfig.model_validate(record["setting"]), str(record.get("why", ""))
