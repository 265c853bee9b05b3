"""The k_sweep stage: K, the drafts per verify step, chosen by timing the trained draft at each K.

At low acceptance a smaller K can serve faster: a rejected draft token still costs its share of the verify step
and of drafting. Per headline set of ``evaluate.sets``, the first turn of each of the first
``k_sweep.timed_prompts`` conversations is decoded alone (prefill included: the engines keep no prefix cache, so
every timed turn, in every round, meets its engine as a new chat turn meets a server; each engine has met every
prompt's length once before timing, so no engine pays the process's first kernel set-up for it), with evaluate's
sampling and engine settings, by the plain engine and by the draft at each K of ``k_sweep.ks``, all started from one
set of kwargs that differ only in ``speculative_config``. The plain engine and up to two speculative ones take
turns prompt by prompt (:func:`~eaglenest.core.measure.beside_plain.time_beside_plain`), so every speed-up divides
seconds measured moments apart; the plain engine stays up for every group of two. ``k_sweep.repeats`` rounds
time the same engines again. (n-gram drafting's window and K are the free_sweep stage's.)

Output ``metrics/k_sweep.json`` (:mod:`eaglenest.artifacts.k_record`, kept in git): the draft's fingerprint,
``serve_k`` (over all headline sets' timed turns, pooled: the smallest K whose speed-up's interval reaches the
fastest K's, the cheaper step where timing cannot tell them apart; ``details.why`` says which), its speed-up with the
95% interval; per round, drafter, K and set, tokens/s, the speed-up over the plain engine timed beside it with its
interval, and tau over the steps that had a draft; per set the best K; and where the stage's seconds went. Where
``evaluate.backend`` lists no vllm (a verifier vLLM does not run), no K is measured and the record says so;
``eaglenest serve`` then serves the draft's own K.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.artifacts.draft import draft_algorithm, draft_tokens, vllm_speculative_config
from eaglenest.artifacts.eval_sets import load_eval_sets
from eaglenest.artifacts.k_record import ServedFigure, write_k_record
from eaglenest.artifacts.verifier import load_tokenizer, load_verifier_info
from eaglenest.core.errors import EaglenestError
from eaglenest.core.host import host_record, short_commit
from eaglenest.core.measure import engines as kit_engines
from eaglenest.core.measure.beside_plain import TimedTurns, time_beside_plain
from eaglenest.core.measure.engines import EngineBase, drafting, request_tokens
from eaglenest.core.stage import DraftInput, Stage, path_arg
from eaglenest.stages.k_sweep.choice import best_ks, serve_k
from eaglenest.stages.k_sweep.params import KSweepStageParams

log = logging.getLogger(__name__)

PARAM = "k_sweep"  # the params section named in vLLM's errors
# Engines timed beside the plain one at once: on a GPU each of the three holds a third of
# evaluate.vllm.gpu_memory_utilization.
SPECULATIVE_PER_GROUP = 2


@dataclass(frozen=True)
class KSweepPaths(DraftInput):
    """Where dvc.yaml puts the k_sweep stage's inputs and output."""

    out: Path = path_arg("the K record (metrics/k_sweep.json)")


def timed_turns(params: KSweepStageParams, paths: KSweepPaths, max_k: int) -> TimedTurns:
    """The headline sets' timed prompts, rendered as evaluate renders a first turn."""
    tokenizer = load_tokenizer(paths.verifier)
    sets = [s for s in load_eval_sets(params.evaluate.sets, paths.prepared, tokenizer) if s.params.headline]
    count = params.k_sweep.timed_prompts
    prompts = {s.name: [s.render(c, 0, [], tokenizer) for c in s.conversations[:count]] for s in sets}
    first = sets[0]
    spare = first.conversations[count] if len(first.conversations) > count else first.conversations[-1]
    warm_up = first.render(spare, 0, [], tokenizer)
    answer = max(s.params.max_new_tokens for s in sets)
    requests = [request_tokens(len(p), answer, max_k) for p in [warm_up, *(p for ps in prompts.values() for p in ps)]]
    return TimedTurns(sets, prompts, warm_up, requests)


def sweep_ks(asked: list[int] | None, own_k: int) -> list[int]:
    """The Ks timed: those asked for, each once, in order; else 1 to the draft's own K."""
    return sorted(set(asked)) if asked else list(range(1, own_k + 1))


def sweep(
    params: KSweepStageParams, paths: KSweepPaths, ks: list[int] | None = None, repeats: int | None = None
) -> dict[str, Any]:
    """Times the draft at each K and writes the record to ``paths.out``; returns it.

    Args:
        params: The whole params file (``k_sweep`` and the evaluate settings it reads).
        paths: The stage's paths.
        ks: The Ks to time instead of ``k_sweep.ks`` (``eaglenest k-sweep --ks``).
        repeats: Rounds instead of ``k_sweep.repeats``.
    """
    own = params.k_sweep
    repeats = repeats or own.repeats
    trained_k = draft_tokens(paths.draft, "the draft")  # one line before a minute of engine start
    algorithm = draft_algorithm(paths.draft, "the draft")
    ks = sweep_ks(ks or own.ks, trained_k)
    if min(ks) < 1 or repeats < 1:
        raise EaglenestError(
            f"k_sweep.ks and k_sweep.repeats (or --ks, --repeats): every K and the rounds must be at "
            f"least 1 (Ks {ks}, repeats {repeats})"
        )
    if "vllm" not in params.evaluate.backend:
        reason = (
            "evaluate.backend lists no vllm: the K served is vLLM's, and the sweep times vLLM's engines; list "
            "vllm in evaluate.backend to measure it"
        )
        log.info("no K measured: %s", reason)
        return write_k_record(paths.out, paths.draft, algorithm, trained_k, None, {"ks": ks}, not_measured=reason)
    return _measure(params, paths, ks, repeats, trained_k, algorithm)


def _measure(
    params: KSweepStageParams, paths: KSweepPaths, ks: list[int], repeats: int, trained_k: int, algorithm: str
) -> dict[str, Any]:
    """The timing: the plain engine up throughout, the speculative engines two at a time beside it; the record."""
    evaluate, own = params.evaluate, params.k_sweep
    began = time.perf_counter()
    turns = timed_turns(params, paths, max(ks))
    info, model_dir = load_verifier_info(paths.verifier)
    # one prompt at a time (the KV cache holds one request); up to three engines hold GPU memory at once
    base = EngineBase(model_dir, info, evaluate.vllm, evaluate.seed, at_once=SPECULATIVE_PER_GROUP + 1)
    common = base.kwargs(turns.requests)
    groups = [ks[i : i + SPECULATIVE_PER_GROUP] for i in range(0, len(ks), SPECULATIVE_PER_GROUP)]
    seconds: dict[str, Any] = {"start": {}, "timed": {}}
    rounds: list[dict[str, Any]] = [{"draft": {str(k): {} for k in ks}} for _ in range(repeats)]

    plain = None
    try:
        plain, seconds["start"]["plain"] = kit_engines.start_engine(
            common, PARAM, "the verifier", turns.warm_up, evaluate.seed, turns.every_prompt
        )
        for group in groups:
            engines: dict[str, Any] = {}
            try:
                for k in group:
                    name = f"draft K={k}"
                    engines[name], seconds["start"][name] = kit_engines.start_engine(
                        drafting(common, vllm_speculative_config(paths.draft, k)),
                        PARAM,
                        f"the {algorithm} draft at K={k}",
                        turns.warm_up,
                        evaluate.seed,
                        turns.every_prompt,
                    )
                label = ", ".join(engines)
                for round_number, measured in enumerate(rounds):
                    started = time.perf_counter()
                    timed = time_beside_plain(turns, plain, engines, evaluate, PARAM, f"round {round_number}")
                    seconds["timed"][f"round {round_number}: {label}"] = round(time.perf_counter() - started, 3)
                    for k in group:
                        measured["draft"][str(k)] = timed[f"draft K={k}"]
                        log.info(
                            "round %d, draft K=%d: %s",
                            round_number,
                            k,
                            ", ".join(
                                f"{n} x{e['speedup']} ± {e['speedup_ci95']}"
                                for n, e in measured["draft"][str(k)].items()
                            ),
                        )
            finally:
                for llm in engines.values():
                    kit_engines.stop_engine(llm)
    finally:
        if plain is not None:
            kit_engines.stop_engine(plain)

    names = [s.name for s in turns.sets]
    k_best, speedup, ci95, why = serve_k(rounds, names, ks, evaluate.bootstrap_samples, evaluate.seed)
    seconds["total"] = round(time.perf_counter() - began, 3)
    log.info(
        "serve K=%d: x%.2f ± %.2f over %s (the draft's own K is %d): %s",
        k_best,
        speedup,
        ci95,
        ", ".join(names),
        trained_k,
        why,
    )
    details = {
        "commit": short_commit(),
        "host": host_record(common["dtype"]),
        "ks": ks,
        "repeats": repeats,
        "timed_prompts": own.timed_prompts,
        "drafters": ["draft"],
        "best": best_ks(rounds, names, ks, ["draft"]),
        "why": why,
        "seconds": seconds,
        "rounds": rounds,
    }
    return write_k_record(
        paths.out, paths.draft, algorithm, trained_k, ServedFigure(k_best, speedup, ci95, names), details
    )


STAGE = Stage(
    "k_sweep",
    "K, the drafts per verify step, timed for the trained draft at each K on the headline sets "
    "(plain and draft interleaved): the K eaglenest serve uses for it.",
    KSweepStageParams,
    KSweepPaths,
    sweep,
)
