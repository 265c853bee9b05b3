"""The evaluate stage: the trained draft in real speculative decoding, against plain decoding.

Metrics (``metrics/eval.json``):

* ``tau`` — mean tokens emitted per verifier forward, vLLM's definition ``1 + accepted / verify_steps``;
  ``per_position_acceptance[i]`` — fraction of verify steps whose i-th draft was accepted;
  ``draft_acceptance_rate`` — accepted / drafted.
* ``identical_fraction`` — prompts whose speculative output equals plain decoding of the same engine in
  the same dtype token for token (every back end).
* ``lossless_fraction`` — prompts whose speculative output counts as lossless; at temperature 0 anything
  below 1.0 fails the stage. What counts depends on the arithmetic:

  - ``hf`` (always float32) and ``vllm`` with ``evaluate.vllm.dtype: float32``: exact token equality with
    plain greedy decoding, so ``lossless_fraction == identical_fraction``. In float32 the verify forward
    over K drafts picks the same argmax as K single-token forwards; any difference is a bug.
  - ``vllm`` below float32 (bfloat16, float16; ``auto`` on an fp32 checkpoint is bfloat16): a prompt is
    lossless if its speculative output is identical to plain, or if at the first position where they
    differ the token speculation emitted is among the plain run's top ``TIE_CANDIDATES`` there and its
    log-prob is at most ``evaluate.bf16_tie_margin`` below the plain run's top token. A verify forward
    over K+1 positions sums in a different order than a one-token forward, and bf16 rounding (about 3
    significant digits) flips near-ties; a broken
    acceptance rule emits tokens far from the verifier's top choice. Tokens after the first difference
    follow a different context and are not compared (README: how often this happens on SmolLM2).

* ``tokens_per_s_plain`` / ``tokens_per_s_spec`` / ``speedup`` — same process, same prompts, after a
  warm-up, each prompt decoded alone (single stream, as a chat user sees it). ``hf``: the plain figure is
  transformers' own ``generate``. ``vllm`` also reports ``*_batched``: all prompts in one ``generate`` call.
* ``tau_ngram`` — prompt-lookup (n-gram) drafting with the same K on the same prompts: the baseline.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.artifacts.verifier import load_tokenizer
from eaglenest.core.atomic import atomic_write_json
from eaglenest.core.errors import EaglenestError
from eaglenest.core.params import EvaluateParams, Params
from eaglenest.core.registry import Registry
from eaglenest.core.stage import Stage, path_arg
from eaglenest.stages.evaluate.job import Backend, EvaluationJob
from eaglenest.stages.evaluate.prompts import load_prompt_sets

log = logging.getLogger(__name__)

BACKENDS: Registry[Backend] = Registry("evaluate back end")


@BACKENDS.entry("hf")
def _hf(job: EvaluationJob) -> dict[str, dict[str, Any]]:
    from eaglenest.stages.evaluate.hf import evaluate_draft_hf

    return evaluate_draft_hf(job)


@BACKENDS.entry("vllm")
def _vllm(job: EvaluationJob) -> dict[str, dict[str, Any]]:
    from eaglenest.stages.evaluate.vllm import evaluate_draft_vllm  # imports vllm once its engine starts

    return evaluate_draft_vllm(job)


# The scalars repeated under flat per-set names (tau_general, vllm_speedup_val, ...), so that
# `dvc metrics diff` shows every set and back end side by side; the full figures stay under "sets".
FLAT_PER_SET = ("tau", "speedup", "speedup_batched", "lossless_fraction", "identical_fraction", "tau_ngram",
                "tokens_per_s_plain", "tokens_per_s_spec")


def flat_metrics(results: dict[str, dict[str, dict[str, Any]]], primary: str) -> dict[str, Any]:
    """``results[backend][set]`` as one flat mapping: the primary back end's ``val`` figures under their own
    names (as before there were sets), then ``{backend_}{metric}_{set}`` for every set, where the primary
    back end has no prefix; per-position acceptance as ``acceptance_pos_{i}[_{set}]``."""
    flat: dict[str, Any] = dict(results[primary]["val"])
    flat.update({f"acceptance_pos_{i + 1}": rate
                 for i, rate in enumerate(results[primary]["val"]["per_position_acceptance"])})
    for backend, sets in results.items():
        prefix = "" if backend == primary else f"{backend}_"
        for set_name, metrics in sets.items():
            for key in FLAT_PER_SET:
                if key in metrics:
                    flat[f"{prefix}{key}_{set_name}"] = metrics[key]
            for i, rate in enumerate(metrics["per_position_acceptance"]):
                flat[f"{prefix}acceptance_pos_{i + 1}_{set_name}"] = rate
    flat["sets"] = {set_name: {backend: results[backend][set_name] for backend in results}
                    for set_name in results[primary]}
    return flat


def write_eval_outputs(results: dict[str, dict[str, dict[str, Any]]], primary: str, metrics_path: Path,
                       plots_dir: Path) -> dict[str, Any]:
    """metrics/eval.json plus the two plot tables dvc.yaml declares (every set and back end); returns the
    flat metrics."""
    flat = flat_metrics(results, primary)
    atomic_write_json(metrics_path, flat)
    acceptance, tau = [], []
    for backend, sets in results.items():
        for set_name, metrics in sets.items():
            for drafter, rates in (("eagle3", metrics["per_position_acceptance"]),
                                   ("ngram", metrics.get("per_position_acceptance_ngram", []))):
                label = f"{drafter} {backend} {set_name}"
                acceptance += [{"position": i + 1, "drafter": label, "series": f"{label} {i + 1}", "acceptance": rate}
                               for i, rate in enumerate(rates)]
            tau += [{"drafter": f"eagle3 {backend} {set_name}", "tau": metrics["tau"]},
                    {"drafter": f"ngram {backend} {set_name}", "tau": metrics["tau_ngram"]}]
    k = results[primary]["val"]["num_speculative_tokens"]
    atomic_write_json(plots_dir / "acceptance.json", acceptance)
    atomic_write_json(plots_dir / "tau.json", [*tau, {"drafter": "upper bound (K+1)", "tau": k + 1}])
    return flat


def evaluate(params: EvaluateParams, verifier_dir: Path, prepared_dir: Path, draft_dir: Path, metrics_path: Path,
             plots_dir: Path) -> dict[str, Any]:
    """The evaluate stage: every back end of evaluate.backend on every prompt set."""
    tokenizer = load_tokenizer(verifier_dir)
    job = EvaluationJob(params, verifier_dir, load_prompt_sets(params, prepared_dir, tokenizer), draft_dir)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for backend in params.backends:
        results[backend] = BACKENDS.get(backend)(job)
        for set_name, metrics in results[backend].items():
            log.info("%s, %s prompts: tau %.3f (n-gram %.3f), speed-up %.3f, lossless %.2f", backend, set_name,
                     metrics["tau"], metrics["tau_ngram"], metrics["speedup"], metrics["lossless_fraction"])
    primary = params.backends[0]
    metrics = write_eval_outputs(results, primary, metrics_path, plots_dir)
    for backend, sets in results.items():
        for set_name, figures in sets.items():
            _require_lossless(params, figures, backend, set_name, metrics_path)
    return metrics


def _require_lossless(params: EvaluateParams, metrics: dict[str, Any], backend: str, set_name: str,
                      metrics_path: Path) -> None:
    """At temperature 0 every prompt must be lossless; otherwise the verification is wrong, whatever the draft.

    Raises:
        EaglenestError: naming the back end, the set and the rule.
    """
    if params.temperature > 0 or metrics["lossless_fraction"] >= 1.0:
        return
    rule = ("identical tokens" if metrics.get("lossless_rule", "exact") == "exact" else
            f"identical, or a near-tie flipped within evaluate.bf16_tie_margin={params.bf16_tie_margin}")
    raise EaglenestError(
        f"lossless_fraction = {metrics['lossless_fraction']} < 1.0 at temperature 0 (evaluate.backend: {backend}, "
        f"{set_name} prompts, rule: {rule}): greedy speculative decoding left plain greedy decoding on some of "
        f"{metrics['num_prompts']} prompts: the verification (acceptance rule) is wrong, whatever the draft; see "
        f"divergence_gaps under sets.{set_name}.{backend} in {metrics_path}"
    )


@dataclass(frozen=True)
class EvaluatePaths:
    """Where dvc.yaml puts the evaluate stage's inputs and outputs."""

    verifier: Path = path_arg("the verifier stage's output folder")
    prepared: Path = path_arg("the prepare stage's dataset folder (its held-out prompts)")
    draft: Path = path_arg("the train stage's draft checkpoint")
    metrics: Path = path_arg("metrics JSON (metrics/eval.json)")
    plots: Path = path_arg("folder for the plot tables (metrics/eval_plots)")


def run(params: Params, paths: EvaluatePaths) -> dict[str, Any]:
    """The evaluate stage."""
    return evaluate(params.evaluate, paths.verifier, paths.prepared, paths.draft, paths.metrics, paths.plots)


STAGE = Stage("evaluate", "The draft in real speculative decoding: tau, lossless check, speed-up, n-gram baseline.",
              EvaluatePaths, run)
