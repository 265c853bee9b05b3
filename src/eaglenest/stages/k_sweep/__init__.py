"""The k_sweep stage: K, the drafts per verify step, chosen by timing the trained draft at each K.

At low acceptance a smaller K can serve faster: a rejected draft token still costs its share of the verify step
and of drafting. Per headline set of ``evaluate.sets``, the first turn of each of the first
``k_sweep.timed_prompts`` conversations is decoded alone (prefill included: the engines keep no prefix cache, so
every timed turn, in every round, meets its engine as a new chat turn meets a server; each engine has met every
prompt's length once before timing, so no engine pays the process's first kernel set-up for it), with evaluate's
sampling and engine settings, by the plain engine and by the draft at each K of ``k_sweep.ks`` (with
``k_sweep.ngram``, also by vLLM's n-gram drafting at each K). The plain engine and up to two speculative ones take
turns prompt by prompt (:func:`~eaglenest.core.measure.single_stream.time_interleaved`), so every speed-up divides
seconds measured moments apart; the plain engine stays up for every group of two. ``k_sweep.repeats`` rounds
time the same engines again.

Output ``metrics/k_sweep.json`` (:mod:`eaglenest.artifacts.k_record`, kept in git): the draft's fingerprint,
``serve_k`` (the K with the best speed-up over all headline sets' timed turns, pooled), its speed-up with the
95% interval; per round, drafter, K and set, tokens/s, the speed-up over the plain engine timed beside it with its
interval, and tau over the steps that had a draft; per set the best K; and where the stage's seconds went. Where
``evaluate.backend`` lists no vllm (a verifier vLLM does not run), no K is measured and the record says so;
``eaglenest serve`` then serves the draft's own K.
"""

from __future__ import annotations

import logging
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.artifacts.draft import draft_algorithm, draft_tokens, vllm_speculative_config
from eaglenest.artifacts.eval_sets import EvalSet, load_eval_sets
from eaglenest.artifacts.k_record import ServedFigure, write_k_record
from eaglenest.artifacts.verifier import load_tokenizer, load_verifier_info
from eaglenest.core.errors import EaglenestError
from eaglenest.core.eval_params import EvalSetsAndEngines
from eaglenest.core.host import host_record
from eaglenest.core.measure import engines as kit_engines
from eaglenest.core.measure import single_stream
from eaglenest.core.measure.engines import EngineBase, request_tokens
from eaglenest.core.measure.spec_counters import SpecCounts, request_counts
from eaglenest.core.stage import DraftInput, Stage, path_arg
from eaglenest.stages.k_sweep.choice import add_speedup, best_ks, serve_k
from eaglenest.stages.k_sweep.params import KSweepStageParams

log = logging.getLogger(__name__)

PARAM = "k_sweep"  # the params section named in vLLM's errors
# Engines timed beside the plain one at once: the CPU build holds three per process, a GPU a third of
# evaluate.vllm.gpu_memory_utilization each.
SPECULATIVE_PER_GROUP = 2


@dataclass(frozen=True)
class KSweepPaths(DraftInput):
    """Where dvc.yaml puts the k_sweep stage's inputs and output."""

    out: Path = path_arg("the K record (metrics/k_sweep.json)")


@dataclass(frozen=True)
class TimedTurns:
    """The headline sets and the prompts timed on them.

    Attributes:
        sets: The headline sets.
        prompts: Set name -> the first turn of each of its first k_sweep.timed_prompts conversations (token ids).
        warm_up: A prompt no engine is timed on (the first set's next conversation, where it has one).
        requests: The most tokens each engine's requests reach (timed and warm-up prompts with their answers and
            the largest K's drafts).
    """

    sets: list[EvalSet]
    prompts: dict[str, list[list[int]]]
    warm_up: list[int]
    requests: list[int]

    @property
    def every_prompt(self) -> list[list[int]]:
        """The timed prompts of every set, in order."""
        return [prompt for prompts in self.prompts.values() for prompt in prompts]


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


def sweep(params: KSweepStageParams, paths: KSweepPaths, ks: list[int] | None = None, repeats: int | None = None
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
        raise EaglenestError(f"k_sweep.ks and k_sweep.repeats (or --ks, --repeats): every K and the rounds must be at "
                             f"least 1 (Ks {ks}, repeats {repeats})")
    if "vllm" not in params.evaluate.backend:
        reason = ("evaluate.backend lists no vllm: the K served is vLLM's, and the sweep times vLLM's engines; list "
                  "vllm in evaluate.backend to measure it")
        log.info("no K measured: %s", reason)
        return write_k_record(paths.out, paths.draft, algorithm, trained_k, None, {"ks": ks}, not_measured=reason)
    return _measure(params, paths, ks, repeats, trained_k, algorithm)


def _measure(params: KSweepStageParams, paths: KSweepPaths, ks: list[int], repeats: int, trained_k: int, algorithm: str
             ) -> dict[str, Any]:
    """The timing: the plain engine up throughout, the speculative engines two at a time beside it; the record."""
    evaluate, own = params.evaluate, params.k_sweep
    began = time.perf_counter()
    turns = timed_turns(params, paths, max(ks))
    info, model_dir = load_verifier_info(paths.verifier)
    # one prompt at a time (the KV cache holds one request); up to three engines hold GPU memory at once
    base = EngineBase(model_dir, info, evaluate.vllm, evaluate.seed, at_once=SPECULATIVE_PER_GROUP + 1)
    common = base.kwargs(turns.requests)
    drafters = ["draft", "ngram"] if own.ngram else ["draft"]
    speculative = {(drafter, k): (vllm_speculative_config(paths.draft, k) if drafter == "draft"
                                  else kit_engines.ngram_config(evaluate, k)[0]) for drafter in drafters for k in ks}
    groups = [list(speculative)[i:i + SPECULATIVE_PER_GROUP]
              for i in range(0, len(speculative), SPECULATIVE_PER_GROUP)]
    seconds: dict[str, Any] = {"start": {}, "timed": {}}
    rounds: list[dict[str, Any]] = [{drafter: {str(k): {} for k in ks} for drafter in drafters}
                                    for _ in range(repeats)]

    plain = None
    try:
        plain, seconds["start"]["plain"] = kit_engines.start_engine(common, PARAM, "the verifier", turns.warm_up,
                                                                    evaluate.seed, turns.every_prompt)
        for group in groups:
            engines: dict[str, Any] = {}
            try:
                for drafter, k in group:
                    name = f"{drafter} K={k}"
                    engines[name], seconds["start"][name] = kit_engines.start_engine(
                        base.kwargs(turns.requests, speculative_config=speculative[drafter, k]), PARAM,
                        f"the {algorithm} draft at K={k}" if drafter == "draft" else f"n-gram drafting at K={k}",
                        turns.warm_up, evaluate.seed, turns.every_prompt)
                label = ", ".join(engines)
                for round_number, measured in enumerate(rounds):
                    started = time.perf_counter()
                    timed = time_beside_plain(turns, plain, engines, evaluate, f"round {round_number}")
                    seconds["timed"][f"round {round_number}: {label}"] = round(time.perf_counter() - started, 3)
                    for drafter, k in group:
                        measured[drafter][str(k)] = timed[f"{drafter} K={k}"]
                        log.info("round %d, %s K=%d: %s", round_number, drafter, k, ", ".join(
                            f"{n} x{e['speedup']} ± {e['speedup_ci95']}" for n, e in measured[drafter][str(k)].items()))
            finally:
                for llm in engines.values():
                    kit_engines.close_engine(llm)
    finally:
        if plain is not None:
            kit_engines.close_engine(plain)

    names = [s.name for s in turns.sets]
    k_best, speedup, ci95 = serve_k(rounds, names, ks, evaluate.bootstrap_samples, evaluate.seed)
    seconds["total"] = round(time.perf_counter() - began, 3)
    log.info("serve K=%d: x%.2f ± %.2f over %s (the draft's own K is %d)", k_best, speedup, ci95, ", ".join(names),
             trained_k)
    details = {"commit": short_commit(), "host": host_record(common["dtype"]), "ks": ks, "repeats": repeats,
               "timed_prompts": own.timed_prompts, "drafters": drafters,
               "ngram_window": list(kit_engines.ngram_config(evaluate, 1)[1]) if own.ngram else None,
               "best": best_ks(rounds, names, ks, drafters), "seconds": seconds, "rounds": rounds}
    return write_k_record(paths.out, paths.draft, algorithm, trained_k, ServedFigure(k_best, speedup, ci95, names),
                          details)


def time_beside_plain(turns: TimedTurns, plain: Any, engines: dict[str, Any], evaluate: EvalSetsAndEngines, label: str
                      ) -> dict[str, dict[str, Any]]:
    """Every headline set's timed turns on the plain engine and ``engines`` (name -> speculative engine), taking
    turns prompt by prompt; per engine and set its figures beside the plain engine's (:func:`timed_entry`), with the
    speed-up and its 95% interval."""
    result: dict[str, dict[str, Any]] = {name: {} for name in engines}
    for eval_set in turns.sets:
        sampling = kit_engines.sampling_params(eval_set.params.max_new_tokens, eval_set.params.temperature,
                                               evaluate.seed)
        timed = single_stream.time_interleaved({"plain": plain, **engines}, turns.prompts[eval_set.name], sampling,
                                               PARAM, f"{label}, {eval_set.name}, {', '.join(engines)}")
        plain_turns = single_stream.tokens_and_seconds(timed["plain"])
        for name in engines:
            entry = timed_entry(timed[name], plain_turns)
            add_speedup(entry, evaluate.bootstrap_samples, evaluate.seed)
            result[name][eval_set.name] = entry
    return result


def timed_entry(timed: list[single_stream.Timed], plain_turns: list[list[float]]) -> dict[str, Any]:
    """One set's figures for one speculative engine: its turns beside the plain engine's, tokens/s of both, and tau
    over the verify steps that had a draft (every step, for a draft; n-gram drafts only on a match)."""
    turns = single_stream.tokens_and_seconds(timed)
    entry: dict[str, Any] = {"tokens_per_s": _rate(turns), "plain_tokens_per_s": _rate(plain_turns),
                             "turns": turns, "plain_turns": plain_turns}
    counts = [request_counts(output) for output, _ in timed]
    if counts and all(c is not None for c in counts):
        summed = sum(counts, SpecCounts())  # type: ignore[arg-type]
        entry |= {"steps_with_draft": summed.drafts, "tau_when_drafted": round(summed.tau or 1.0, 3)}
    return entry


def _rate(turns: list[list[float]]) -> float:
    return round(sum(t for t, _ in turns) / max(sum(s for _, s in turns), 1e-9), 2)


def short_commit() -> str:
    """The checkout's commit the figures were measured at ("unknown" outside git)."""
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


def run(params: KSweepStageParams, paths: KSweepPaths) -> dict[str, Any]:
    """The k_sweep stage."""
    return sweep(params, paths)


STAGE = Stage("k_sweep", "K, the drafts per verify step, timed for the trained draft at each K on the headline sets "
              "(plain and draft interleaved): the K eaglenest serve uses for it.", KSweepStageParams, KSweepPaths, run)
