"""The evaluate stage: the trained draft in real speculative decoding, against plain decoding and against
vLLM's own free drafters (n-gram drafting, suffix decoding), on fixed evaluation sets (``evaluate.sets``,
:mod:`eaglenest.artifacts.eval_sets`).

Outputs:

* ``metrics/eval.json`` — the headline, what ``dvc metrics diff`` shows: per headline set, the serving back
  end's (vllm where listed, else hf) ``<backend>_tau`` and ``<backend>_speedup``, each with its 95% interval's
  half-width (``_ci95``), ``<backend>_tau_timed`` (tau on the timed turns as they were decoded alone, beside tau
  on the whole set) and the verdict's figure ``<backend>_vs_free`` (the draft's single-stream speed over the
  fastest free drafter's, ``<backend>_free``, paired conversation by conversation, with its half-width: ahead where
  the interval lies above 1, behind where below, else a tie); each free drafter's and the hybrid's speed-up
  (``_ngram_speedup``, ``_suffix_speedup``, ``_hybrid_speedup``) and the hybrid's speed over the fastest free
  drafter, paired, with its half-width (``_hybrid_vs_free``); ``lossless``, the smallest lossless fraction of any
  greedy set, back end and drafter. At most a dozen numbers per headline set, so that ``dvc metrics diff`` stays a
  glance: the intervals of the other speed-ups, and the draft over each free drafter, live in details.json.
* ``metrics/eval/records.json`` — one record per decoded turn, per back end and set
  (:mod:`eaglenest.artifacts.evaluation`): what the report pairs between revisions.
* ``metrics/eval/details.json`` — every figure, per back end and set: tau and speed-up with their intervals,
  acceptance per position, the n-gram baseline, tokens/s, lossless counts, tau per category; per back end the
  seconds of its phases (engine starts, batched passes, timed turns: where the stage's time goes); and the host kind
  that measured them (:func:`eaglenest.core.host.host_record`, with the serving back end's compute dtype).
* ``metrics/eval/acceptance.json`` — acceptance per position, draft against n-gram (dvc.yaml's plot).

Definitions:

* ``tau`` — tokens emitted per verifier forward, vLLM's ``1 + accepted / verify_steps``, summed over a set's
  turns; its interval resamples conversations (bootstrap, ``evaluate.bootstrap_samples``).
* ``speedup`` — single-stream tokens/s of speculative over plain decoding, each turn decoded alone, same
  engine, same process, after a warm-up (vllm: the first ``evaluate.timed_prompts`` turns of each set; hf:
  every turn it decodes). The free drafters are vLLM's own ``ngram`` method at the lookup window and K, and its
  ``suffix`` method at the tree depth, spec factor, least probability and K, the free_sweep stage measured fastest
  (``--ngram``, its record; vLLM's defaults at the draft's K without one), timed the same way; their tau is
  conditional on a proposal (vLLM counts only steps where they proposed), so compare them by speed.
* ``identical`` — the speculative output equals plain decoding of the same engine token for token.
* ``lossless`` — at temperature 0 anything below 1.0 fails the stage. ``hf`` (float32) and ``vllm`` in float32
  use exact token equality: in float32 the verify forward over K drafts picks the same argmax as K one-token
  forwards, so any difference is a bug. ``vllm`` below float32 (``auto`` on an fp32 checkpoint is bfloat16):
  a turn is also lossless if at the first differing position the token speculation emitted is among the plain
  run's top ``TIE_CANDIDATES`` and its log-prob is at most ``evaluate.bf16_tie_margin`` below the top token: a
  verify forward over K+1 positions sums in a different order than a one-token forward, and bf16 rounding
  flips near-ties, while a broken acceptance rule emits tokens far from the verifier's choice. At a sampling
  temperature outputs differ by design; speculative sampling keeps the verifier's distribution instead.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.artifacts.draft import draft_algorithm
from eaglenest.artifacts.eval_params import EvaluateParams
from eaglenest.artifacts.eval_sets import load_eval_sets
from eaglenest.artifacts.evaluation import DETAILS_FILE, RECORDS_FILE, headline, records_path, summarize
from eaglenest.artifacts.verifier import load_tokenizer
from eaglenest.core.atomic import atomic_write_json
from eaglenest.core.errors import EaglenestError
from eaglenest.core.host import host_record
from eaglenest.core.registry import Registry
from eaglenest.core.stage import DraftInput, Stage, path_arg
from eaglenest.stages.evaluate.job import Backend, EvaluationJob
from eaglenest.stages.evaluate.params import EvaluateStageParams

log = logging.getLogger(__name__)

BACKENDS: Registry[Backend] = Registry("evaluate back end")
ACCEPTANCE_FILE = "acceptance.json"


@BACKENDS.entry("hf")
def _hf(job: EvaluationJob) -> dict[str, Any]:
    from eaglenest.stages.evaluate.hf import evaluate_draft_hf

    return evaluate_draft_hf(job)


@BACKENDS.entry("vllm")
def _vllm(job: EvaluationJob) -> dict[str, Any]:
    from eaglenest.stages.evaluate.vllm import evaluate_draft_vllm  # imports vllm once its engine starts

    return evaluate_draft_vllm(job)


def write_eval_outputs(
    params: EvaluateParams,
    results: dict[str, dict[str, Any]],
    metrics_path: Path,
    out_dir: Path,
    algorithm: str = "eagle3",
) -> dict[str, Any]:
    """The records, the details, the plot table and the headline (written last: dvc trusts what exists);
    ``algorithm`` (the draft's, ``train.algorithm``) names the draft's series in the plot table."""
    k = next(iter(results.values()))["num_speculative_tokens"]
    records = {"num_speculative_tokens": k, "runs": results}
    details: dict[str, Any] = {
        "num_speculative_tokens": k,
        "headline_backend": params.headline_backend,
        "host": host_record(results[params.headline_backend]["dtype"]),
        "runs": {},
    }
    for backend, run in results.items():
        details["runs"][backend] = {
            "dtype": run["dtype"],
            "phases": run.get("phases", {}),
            **({"hybrid": run["hybrid"]} if "hybrid" in run else {}),
            "sets": {
                name: {key: value for key, value in entry.items() if key != "records"}
                | {
                    "summary": summarize(
                        entry["records"], k, params.bootstrap_samples, params.seed, entry.get("free_drafter", "ngram")
                    )
                }
                for name, entry in run["sets"].items()
            },
        }
    acceptance = []
    for name, entry in details["runs"][params.headline_backend]["sets"].items():
        summary = entry["summary"]
        for drafter, rates in (
            (algorithm, summary["per_position_acceptance"]),
            ("ngram", summary.get("ngram_per_position_acceptance", [])),
            ("suffix", summary.get("suffix_per_position_acceptance", [])),
        ):
            acceptance += [
                {
                    "set": name,
                    "drafter": drafter,
                    "position": i + 1,
                    "series": f"{name} {drafter} {i + 1}",
                    "acceptance": rate,
                }
                for i, rate in enumerate(rates)
            ]
    atomic_write_json(records_path(out_dir), records)
    atomic_write_json(out_dir / DETAILS_FILE, details)
    atomic_write_json(out_dir / ACCEPTANCE_FILE, acceptance)
    figures = headline(details, [s.name for s in params.sets if s.headline], params.headline_backend)
    atomic_write_json(metrics_path, figures)
    return details


def evaluate(
    params: EvaluateParams,
    verifier_dir: Path,
    prepared_dir: Path,
    draft_dir: Path,
    metrics_path: Path,
    out_dir: Path,
    ngram_record: Path | None = None,
) -> dict[str, Any]:
    """The evaluate stage: every back end of evaluate.backend on every set of evaluate.sets, the vllm back end's
    n-gram baseline at the setting ``ngram_record`` holds (the free_sweep stage's)."""
    algorithm = draft_algorithm(draft_dir, "the draft")
    backends = decoding_backends(params, algorithm)
    tokenizer = load_tokenizer(verifier_dir)
    job = EvaluationJob(
        params, verifier_dir, load_eval_sets(params.sets, prepared_dir, tokenizer), draft_dir, ngram_record
    )
    results = {backend: BACKENDS.get(backend)(job) for backend in backends}
    details = write_eval_outputs(params, results, metrics_path, out_dir, algorithm)
    for backend, run in details["runs"].items():
        for name, entry in run["sets"].items():
            summary = entry["summary"]
            speedup = summary.get("speedup", {}).get("value", float("nan"))
            log.info(
                "%s, %s: tau %.3f ± %.3f, speed-up %.3f (n-gram %.3f, suffix %.3f), lossless %.2f",
                backend,
                name,
                summary["tau"]["value"],
                summary["tau"]["ci95"],
                speedup,
                summary.get("ngram_speedup", {}).get("value", float("nan")),
                summary.get("suffix_speedup", {}).get("value", float("nan")),
                summary["lossless_fraction"],
            )
    for backend, run in details["runs"].items():
        for name, entry in run["sets"].items():
            _require_lossless(params, entry, backend, name, out_dir / DETAILS_FILE)
    return json.loads(metrics_path.read_text())


def decoding_backends(params: EvaluateParams, algorithm: str) -> list[str]:
    """The back ends of ``evaluate.backend`` that decode a draft of ``algorithm``: the hf back end's reference
    decoder decodes EAGLE-3 only, so a P-EAGLE or DFlash draft is measured by vllm alone (logged), and refused
    in one line where vllm is not listed."""
    if algorithm == "eagle3" or "hf" not in params.backends:
        return params.backends
    others = [backend for backend in params.backends if backend != "hf"]
    if not others:
        raise EaglenestError(
            f"evaluate.backend: [hf] decodes EAGLE-3 drafts only, and the draft is {algorithm} "
            "(train.algorithm); add vllm to evaluate.backend"
        )
    log.info(
        "the draft is %s: the hf back end's reference decoder decodes EAGLE-3 only; measuring with %s",
        algorithm,
        ", ".join(others),
    )
    return others


def _require_lossless(
    params: EvaluateParams, entry: dict[str, Any], backend: str, set_name: str, details_path: Path
) -> None:
    """At temperature 0 every prompt must be lossless; otherwise the verification is wrong, whatever the draft.

    Raises:
        EaglenestError: naming the back end, the set and the rule.
    """
    summary = entry["summary"]
    fractions = {"the draft": summary["lossless_fraction"], "the hybrid": summary.get("hybrid_lossless_fraction", 1.0)}
    if entry["temperature"] > 0 or min(fractions.values()) >= 1.0:
        return
    drafter, fraction = min(fractions.items(), key=lambda item: item[1])
    rule = (
        "identical tokens"
        if entry.get("lossless_rule", "exact") == "exact"
        else f"identical, or a near-tie flipped within evaluate.bf16_tie_margin={params.bf16_tie_margin}"
    )
    raise EaglenestError(
        f"lossless fraction of {drafter} = {fraction} < 1.0 at temperature 0 (evaluate.backend: {backend}, "
        f"set {set_name}, rule: {rule}): greedy speculative decoding left plain greedy decoding on some of "
        f"{summary['num_turns']} turns: the verification (acceptance rule) is wrong, whatever the draft; see the "
        f"records with {'lossless' if drafter == 'the draft' else 'hybrid_lossless'}: false under "
        f"runs.{backend}.sets.{set_name} in {details_path.with_name(RECORDS_FILE)}"
    )


@dataclass(frozen=True)
class EvaluatePaths(DraftInput):
    """Where dvc.yaml puts the evaluate stage's inputs and outputs."""

    ngram: Path = path_arg(
        "the free_sweep stage's record: the n-gram baseline's window and K (metrics/free_sweep.json)"
    )
    metrics: Path = path_arg("the headline metrics JSON (metrics/eval.json)")
    out: Path = path_arg("folder for the records, details and plot table (metrics/eval)")


def run(params: EvaluateStageParams, paths: EvaluatePaths) -> dict[str, Any]:
    """The evaluate stage."""
    return evaluate(params.evaluate, paths.verifier, paths.prepared, paths.draft, paths.metrics, paths.out, paths.ngram)


STAGE = Stage(
    "evaluate",
    "The draft in real speculative decoding on fixed sets: tau and speed-up with 95% intervals, "
    "lossless check, vLLM n-gram baseline.",
    EvaluateStageParams,
    EvaluatePaths,
    run,
)
