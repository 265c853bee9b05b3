"""What the single-stream benches share: the headline sets' timed turns, and one engine timed on them the way
``evaluate`` times it (its own ``_timed_one_by_one``, after a warm-up call). Run them as scripts (``python
bench/NAME.py``): each engine runs in processes of its own, which vLLM spawns from the script."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.artifacts.draft import draft_tokens
from eaglenest.artifacts.verifier import load_tokenizer, load_verifier_info
from eaglenest.core.params import EvaluateParams, load_params
from eaglenest.core.vllm_support import create_llm
from eaglenest.stages.evaluate.acceptance import total
from eaglenest.stages.evaluate.sets import load_eval_sets
from eaglenest.stages.evaluate.vllm import (
    PARAM,
    _close,
    _generate,
    _timed_one_by_one,
    build_evaluate_llm_kwargs,
    request_acceptance,
)

VERIFIER_DIR, DRAFT_DIR, PREPARED_DIR = Path("models/verifier"), Path("models/draft"), Path("data/prepared")


@dataclass
class TimedTurns:
    """The headline sets of ``params.yaml`` and the first turn of each of their first ``timed_prompts``
    conversations (what evaluate times on single-turn sets), with the engine arguments they need.

    Attributes:
        params: The evaluate params.
        sets: The headline sets.
        prompts: Set name -> rendered prompts (token ids).
        trained_k: The draft's own speculative_tokens.
        common: The ``vllm.LLM`` arguments every engine shares, sized for the largest K asked for.
    """

    params: EvaluateParams
    sets: list[Any]
    prompts: dict[str, list[list[int]]]
    trained_k: int
    common: dict[str, Any]


def timed_turns(max_k: int | None = None) -> TimedTurns:
    """The timed turns of this checkout's headline sets."""
    params = load_params(Path("params.yaml")).evaluate
    tokenizer = load_tokenizer(VERIFIER_DIR)
    sets = [s for s in load_eval_sets(params.sets, PREPARED_DIR, tokenizer) if s.params.headline]
    prompts = {s.name: [s.render(c, 0, [], tokenizer) for c in s.conversations[:params.timed_prompts]] for s in sets}
    trained_k = draft_tokens(DRAFT_DIR, "bench: the draft")
    info, model_dir = load_verifier_info(VERIFIER_DIR)
    longest = max(len(p) for ps in prompts.values() for p in ps)
    k = max(max_k or 0, params.num_speculative_tokens or trained_k)
    common = build_evaluate_llm_kwargs(params, info, model_dir,
                                       context_tokens=longest + max(s.params.max_new_tokens for s in sets) + k + 1)
    return TimedTurns(params, sets, prompts, trained_k, common)


def speculative(config: dict[str, Any]) -> dict[str, Any]:
    """The extra engine arguments of a speculative engine (per-request counts on, as evaluate runs it)."""
    return {"disable_log_stats": False, "per_request_spec_decode_metrics": "summary", "speculative_config": config}


def time_engine(turns: TimedTurns, extra: dict[str, Any], what: str, k: int) -> dict[str, Any]:
    """One engine on every headline set's timed turns: tokens, seconds, tokens/s and, for a speculative engine,
    the verify steps that had a draft and tau over them (every step, for EAGLE-3; n-gram drafts only on a match)."""
    # Each engine in its own processes: vLLM's CPU build cannot start a fourth engine in one process (its kernel
    # overrides are registered again on the wrappers of the last: AttributeError), and a bench starts more.
    llm = create_llm({**turns.common, **extra}, PARAM, what=what)
    from vllm import SamplingParams

    result = {}
    for s in turns.sets:
        sampling = SamplingParams(max_tokens=s.params.max_new_tokens, temperature=s.params.temperature,
                                  seed=turns.params.seed)
        _generate(llm, [turns.prompts[s.name][0]], sampling)  # warm-up
        timed = _timed_one_by_one(llm, turns.prompts[s.name], sampling)
        tokens = sum(len(output.outputs[0].token_ids) for output, _ in timed)
        seconds = sum(elapsed for _, elapsed in timed)
        entry: dict[str, Any] = {"tokens": tokens, "seconds": round(seconds, 3),
                                 "tokens_per_s": round(tokens / seconds, 2)}
        counts = [request_acceptance(output, k) for output, _ in timed]
        if "speculative_config" in extra and all(c is not None for c in counts):
            summed = total(counts, k)  # type: ignore[arg-type]
            entry |= {"steps_with_draft": summed.steps,
                      "tau_when_drafted": round(1 + summed.accepted / max(summed.steps, 1), 3)}
        result[s.name] = entry
    _close(llm)
    return result


def add_speedups(run: dict[str, Any], plain: dict[str, Any]) -> None:
    """Each set's speed-up over the plain engine's tokens/s of the same bench."""
    for name, entry in run.items():
        entry["speedup"] = round(entry["tokens_per_s"] / plain[name]["tokens_per_s"], 3)


def short_commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
