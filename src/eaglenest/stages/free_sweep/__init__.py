"""The free_sweep stage: the free drafters a user would serve instead of a draft, vLLM's n-gram drafting (prompt
lookup) and suffix decoding (Arctic Inference's suffix trees), each at the setting that serves it fastest, measured,
and the fastest of them named: the draft is judged against the strongest free baseline.

The free drafters have no weights: their settings depend on the verifier, the prompts and the machine, not on the
draft, so the stage runs once per verifier and evaluation sets, and an experiment on the draft never re-runs it. On the
headline sets of ``evaluate.sets`` it takes the first turns of the ``free_sweep.timed_prompts`` conversations after
the first ``evaluate.timed_prompts`` (turns the headline speed-ups never use: a setting chosen on the turns it is
then measured on would be flattered by the choice), and:

1. the plain engine decodes them together; every lookup window from ``free_sweep.lookup_min`` to ``lookup_max`` at
   every K of ``free_sweep.ks`` is replayed on its outputs with vLLM's own proposer, and every suffix decoding
   setting of the grid (``free_sweep.suffix_depths`` x ``suffix_spec_factors`` x ``suffix_min_token_probs`` at
   every K of ``suffix_ks``) with Arctic Inference's own cache, in the order the timed engine is given the turns
   (:mod:`~eaglenest.stages.free_sweep.replay`: exact at temperature 0, and no engine); at each K of each drafter
   the setting that needs the fewest verify steps is kept: which accepts the most is a question of tokens, which
   the replay answers exactly;
2. at each K that setting's engine is timed beside the plain engine, turn by turn, the engines taking turns prompt
   by prompt (:func:`~eaglenest.core.measure.beside_plain.time_beside_plain`): which K serves fastest is a
   question of time (a longer proposal costs the verify step more), which only timing answers. Every engine starts
   from one set of kwargs that differ only in ``speculative_config`` (:mod:`eaglenest.core.measure.engines`).

Per drafter, the setting with the best speed-up over the plain engine, every set's turns pooled (ties: the smaller
K), is the one evaluate runs and ``eaglenest serve --baseline ngram|suffix`` serves; the drafter with the better of
the two is named fastest. Output ``metrics/free_sweep.json`` (:mod:`eaglenest.artifacts.free_record`, kept in git):
the verifier's fingerprint, each drafter's setting and its speed-up with its 95% interval, the fastest; every
replayed setting's counts per set; every timed engine's turns and speed-up per set;
where the stage's seconds went; the host kind. Where ``evaluate.backend`` lists no vllm, nothing is measured and the
record says so (evaluate then decodes no n-gram engine of vLLM's either).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.artifacts.eval_sets import load_eval_sets
from eaglenest.artifacts.free_record import FreeFigure, write_free_record
from eaglenest.artifacts.verifier import load_tokenizer, load_verifier_info
from eaglenest.core.errors import EaglenestError
from eaglenest.core.host import host_record, short_commit
from eaglenest.core.measure import engines as kit_engines
from eaglenest.core.measure.beside_plain import TimedTurns, pooled_speedup, time_beside_plain
from eaglenest.core.measure.engines import EngineBase, NgramSetting, SuffixSetting, drafting, request_tokens
from eaglenest.core.measure.single_stream import output_tokens
from eaglenest.core.stage import PreparedInput, Stage, path_arg
from eaglenest.core.vllm_support import generate
from eaglenest.stages.free_sweep.params import FreeSweepStageParams
from eaglenest.stages.free_sweep.replay import (
    Replayed,
    best_suffix_per_k,
    best_window_per_k,
    replay,
    replay_suffix,
    suffix_cache_class,
    suffix_settings,
    vllm_proposer,
    windows,
)

log = logging.getLogger(__name__)

PARAM = "free_sweep"  # the params section named in vLLM's errors


@dataclass(frozen=True)
class FreeSweepPaths(PreparedInput):
    """Where dvc.yaml puts the free_sweep stage's inputs and output."""

    out: Path = path_arg("the n-gram record (metrics/free_sweep.json)")


def tuning_turns(params: FreeSweepStageParams, paths: FreeSweepPaths, max_k: int) -> tuple[TimedTurns, list[str]]:
    """The turns the sweep times: per headline set, the first turns of the ``free_sweep.timed_prompts``
    conversations after the first ``evaluate.timed_prompts``; and the headline sets that have none.

    Raises:
        EaglenestError: no headline set has a conversation after evaluate's timed ones (one line).
    """
    tokenizer = load_tokenizer(paths.verifier)
    sets = [s for s in load_eval_sets(params.evaluate.sets, paths.prepared, tokenizer) if s.params.headline]
    start, count = params.evaluate.timed_prompts, params.free_sweep.timed_prompts
    tuned = [s for s in sets if len(s.conversations) > start]
    skipped = [s.name for s in sets if len(s.conversations) <= start]
    if not tuned:
        raise EaglenestError(
            f"evaluate.sets: no headline set has a conversation after the first evaluate.timed_prompts = {start}, so "
            "the n-gram baseline has no turns to be tuned on that the headline speed-ups do not use; raise a headline "
            "set's num_prompts or lower evaluate.timed_prompts"
        )
    prompts = {s.name: [s.render(c, 0, [], tokenizer) for c in s.conversations[start : start + count]] for s in tuned}
    # a turn the headline times, never one this stage times: the warm-up's figures are not kept
    warm_up = sets[0].render(sets[0].conversations[0], 0, [], tokenizer)
    requests = [request_tokens(len(warm_up), kit_engines.WARM_UP_TOKENS, max_k)]
    requests += [request_tokens(len(p), s.params.max_new_tokens, max_k) for s in tuned for p in prompts[s.name]]
    return TimedTurns(tuned, prompts, warm_up, requests), skipped


def sweep(params: FreeSweepStageParams, paths: FreeSweepPaths) -> dict[str, Any]:
    """Replays every window at every K, times the best window at each K beside the plain engine, and writes the
    record to ``paths.out``; returns it."""
    info, model_dir = load_verifier_info(paths.verifier)
    verifier = {"name": info.name, "fingerprint": info.fingerprint}
    if "vllm" not in params.evaluate.backend:
        reason = (
            "evaluate.backend lists no vllm: the free drafters are vLLM's, and the sweep times vLLM's engines; "
            "list vllm in evaluate.backend to measure them"
        )
        log.info("nothing measured: %s", reason)
        return write_free_record(paths.out, verifier, None, None, {}, not_measured=reason)
    return _measure(params, paths, model_dir, info, verifier)


def _measure(
    params: FreeSweepStageParams, paths: FreeSweepPaths, model_dir: Path, info: Any, verifier: dict[str, str]
) -> dict[str, Any]:
    """The replay and the timing; the record."""
    own, evaluate = params.free_sweep, params.evaluate
    began = time.perf_counter()
    ks, suffix_ks = sorted(own.ks), sorted(own.suffix_ks)
    suffix_cache = suffix_cache_class() if suffix_ks else None  # before any engine: a missing package stops at once
    turns, skipped = tuning_turns(params, paths, max(ks + suffix_ks))
    if skipped:
        log.info(
            "%s: no conversation after evaluate's %d timed ones; tuned on %s",
            ", ".join(skipped),
            evaluate.timed_prompts,
            ", ".join(s.name for s in turns.sets),
        )
    # every engine holds every prompt at once (the plain engine decodes them together for the replay), and every
    # engine is up at once
    base = EngineBase(model_dir, info, evaluate.vllm, evaluate.seed, at_once=1 + len(ks) + len(suffix_ks))
    common = base.kwargs(turns.requests, in_flight=len(turns.every_prompt))
    seconds: dict[str, Any] = {"start": {}}
    engines: dict[str, Any] = {}
    plain = None
    try:
        plain, seconds["start"]["plain"] = kit_engines.start_engine(
            common, PARAM, "the verifier", turns.warm_up, evaluate.seed, turns.every_prompt
        )
        started = time.perf_counter()
        outputs = plain_outputs(plain, turns, evaluate.seed)
        replayed = replay_settings(outputs, own.lookup_min, own.lookup_max, ks)
        suffix_grid = suffix_settings(own.suffix_depths, own.suffix_spec_factors, own.suffix_min_token_probs, suffix_ks)
        replayed_suffix = replay_suffix_settings(suffix_cache, outputs, suffix_grid) if suffix_cache else {}
        seconds["replay"] = round(time.perf_counter() - started, 3)
        totals = {s: sum(per_set.values(), Replayed()) for s, per_set in replayed.items()}
        suffix_totals = {s: sum(per_set.values(), Replayed()) for s, per_set in replayed_suffix.items()}
        candidates: dict[str, NgramSetting | SuffixSetting] = {
            s.label: s for s in best_window_per_k(totals, ks).values()
        }
        if suffix_totals:
            candidates |= {s.label: s for s in best_suffix_per_k(suffix_totals, suffix_ks).values()}
        for setting in candidates.values():
            engines[setting.label], seconds["start"][setting.label] = kit_engines.start_engine(
                drafting(common, setting.speculative_config()),
                PARAM,
                _what(setting),
                turns.warm_up,
                evaluate.seed,
                turns.every_prompt,
            )
        started = time.perf_counter()
        timed = time_beside_plain(turns, plain, engines, evaluate, PARAM, "timed turns")
        seconds["timed"] = round(time.perf_counter() - started, 3)
    finally:
        for llm in [*engines.values(), *([plain] if plain is not None else [])]:
            kit_engines.stop_engine(llm)

    names = [s.name for s in turns.sets]
    pooled = {
        setting: pooled_speedup(list(timed[setting.label].values()), evaluate.bootstrap_samples, evaluate.seed)
        for setting in candidates.values()
    }
    chosen_ngram = max((s for s in pooled if isinstance(s, NgramSetting)), key=lambda s: (pooled[s][0], -s.k))
    suffix_timed = [s for s in pooled if isinstance(s, SuffixSetting)]
    chosen_suffix = max(suffix_timed, key=lambda s: (pooled[s][0], -s.k)) if suffix_timed else None
    for setting, (speedup, ci95) in pooled.items():
        log.info(
            "%s: x%.3f ± %.3f over plain decoding%s",
            _what(setting),
            speedup,
            ci95,
            " (chosen)" if setting in (chosen_ngram, chosen_suffix) else "",
        )
    seconds["total"] = round(time.perf_counter() - began, 3)
    details = {
        "commit": short_commit(),
        "host": host_record(common["dtype"]),
        "ks": ks,
        "windows": [list(w) for w in windows(own.lookup_min, own.lookup_max)],
        "turns": {
            name: {"conversations": [evaluate.timed_prompts, evaluate.timed_prompts + len(turns.prompts[name])]}
            for name in names
        },
        "skipped_sets": skipped,
        "replayed": [
            {
                "window": [s.prompt_lookup_min, s.prompt_lookup_max],
                "k": s.k,
                "sets": {name: vars(counts) for name, counts in per_set.items()},
            }
            for s, per_set in replayed.items()
        ],
        "replayed_suffix": [
            {**_suffix_fields(s), "sets": {name: vars(counts) for name, counts in per_set.items()}}
            for s, per_set in replayed_suffix.items()
        ],
        "timed": {
            setting.label: {
                "drafter": "ngram" if isinstance(setting, NgramSetting) else "suffix",
                **(
                    {"k": setting.k, "window": [setting.prompt_lookup_min, setting.prompt_lookup_max]}
                    if isinstance(setting, NgramSetting)
                    else _suffix_fields(setting)
                ),
                "speedup": pooled[setting][0],
                "speedup_ci95": pooled[setting][1],
                "sets": timed[setting.label],
            }
            for setting in candidates.values()
        },
        "seconds": seconds,
    }
    ngram = (chosen_ngram, FreeFigure(*pooled[chosen_ngram], names))
    suffix = None if chosen_suffix is None else (chosen_suffix, FreeFigure(*pooled[chosen_suffix], names))
    record = write_free_record(paths.out, verifier, ngram, suffix, details)
    log.info("the fastest free drafter: %s", record["fastest"])
    return record


def _what(setting: NgramSetting | SuffixSetting) -> str:
    """The engine's name in logs and errors."""
    kind = "n-gram drafting" if isinstance(setting, NgramSetting) else "suffix decoding"
    return f"{kind} at {setting.label}"


def _suffix_fields(setting: SuffixSetting) -> dict[str, Any]:
    return {
        "k": setting.k,
        "max_tree_depth": setting.max_tree_depth,
        "max_spec_factor": setting.max_spec_factor,
        "min_token_prob": setting.min_token_prob,
    }


Outputs = dict[str, list[tuple[list[int], list[int]]]]


def plain_outputs(plain: Any, turns: TimedTurns, seed: int) -> Outputs:
    """The plain engine's outputs on every set's turns (decoded together, with the set's sampling): per set, each
    turn's (prompt, output), in the order the timed engines are given them."""
    outputs = {}
    for eval_set in turns.sets:
        sampling = kit_engines.sampling_params(eval_set.params.max_new_tokens, eval_set.params.temperature, seed)
        prompts = turns.prompts[eval_set.name]
        decoded = generate(plain, [{"prompt_token_ids": p} for p in prompts], sampling, PARAM)
        outputs[eval_set.name] = list(zip(prompts, (output_tokens(o) for o in decoded), strict=True))
    return outputs


def replay_suffix_settings(
    cache_class: type, outputs: Outputs, settings: list[SuffixSetting]
) -> dict[SuffixSetting, dict[str, Replayed]]:
    """Every suffix decoding setting replayed on the outputs, every set's turns in order through one cache (as the
    timed engine meets them): per setting, its counts per set."""
    order = [(name, pair) for name, pairs in outputs.items() for pair in pairs]
    replayed = {}
    for setting in settings:
        counts = replay_suffix(cache_class, [pair for _, pair in order], setting)
        per_set: dict[str, Replayed] = {name: Replayed() for name in outputs}
        for (name, _), turn in zip(order, counts, strict=True):
            per_set[name] = per_set[name] + turn
        replayed[setting] = per_set
    return replayed


def replay_settings(
    outputs: Outputs, lookup_min: int, lookup_max: int, ks: list[int]
) -> dict[NgramSetting, dict[str, Replayed]]:
    """Every n-gram window at every K replayed on the outputs: per setting, its counts per set."""
    propose = vllm_proposer()
    replayed = {}
    for low, high in windows(lookup_min, lookup_max):
        for k in ks:
            setting = NgramSetting(low, high, k)
            replayed[setting] = {
                name: sum((replay(propose, prompt, output, setting) for prompt, output in pairs), Replayed())
                for name, pairs in outputs.items()
            }
    return replayed


STAGE = Stage(
    "free_sweep",
    "The free drafters, n-gram drafting and suffix decoding, each at the setting measured fastest (replayed, then "
    "timed beside plain decoding on turns the headline does not time), and the fastest named: the baselines "
    "evaluate runs.",
    FreeSweepStageParams,
    FreeSweepPaths,
    sweep,
)
