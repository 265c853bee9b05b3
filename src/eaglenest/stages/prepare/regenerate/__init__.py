"""Self-distillation: the verifier rewrites every assistant turn of a conversation, given the turns before.

A draft must predict what the *verifier* says, not what a data set's humans said. With
``prepare.regenerate: true`` each assistant turn j is replaced by the verifier's own reply to
``messages[:j]`` (earlier assistant turns already regenerated), rendered with its chat template and
generation prompt. Conversations are batched turn by turn; a back end turns a batch of prompts into
replies: ``hf`` (transformers ``generate``, :mod:`eaglenest.stages.prepare.regenerate.hf`) or ``vllm``
(vLLM's GPU or CPU build, :mod:`eaglenest.stages.prepare.regenerate.vllm`), registered in :data:`BACKENDS`.
The same generator writes the prompts of ``builtin:self-instruct`` (:mod:`eaglenest.stages.prepare.self_instruct`).

Results are cached in ``.eaglenest/regenerate-cache/<key>.json`` keyed by the verifier fingerprint, the
regeneration params and the original messages, so re-running prepare for an unrelated param change (or
after a kill) regenerates nothing twice.

The conversations to regenerate are cut into batches; each batch is one task of ``cluster.executor``
(:mod:`eaglenest.core.executor`): this process runs them in turn with the verifier it has loaded, or a pool of Ray
actors, each loading the verifier once, runs them in parallel. Either way a batch is the same conversations with
the same seeds (``prepare.seed`` + the batch's start + the turn), run by :func:`regenerate_batch`, and this
process writes the cache entries as batches finish, so both give the same replies.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.artifacts.verifier import VerifierInfo
from eaglenest.core.atomic import atomic_write_json
from eaglenest.core.chat import chat_template_kwargs, strip_reasoning
from eaglenest.core.checkout import checkout_path
from eaglenest.core.executor import EngineNeeds, Executor, check_cluster, open_executor
from eaglenest.core.params import ClusterParams
from eaglenest.core.progress import progress
from eaglenest.core.registry import Registry
from eaglenest.core.vllm_support import serving_dtype
from eaglenest.stages.prepare.params import PrepareParams
from eaglenest.stages.prepare.regenerate.job import GeneratorJob, ReplyBackend, ReplyGenerator, Sampling

log = logging.getLogger(__name__)

CACHE_ROOT = Path(".eaglenest") / "regenerate-cache"


@dataclass
class RegenerationStats:
    """What regeneration did, for metrics/prepare.json."""

    cache_hits: int = 0
    turns: int = 0
    tokens: int = 0
    seconds: float = 0.0


# Conversations -> the same with every assistant turn rewritten by the verifier, and what that took.
Regenerator = Callable[[list[list[dict[str, str]]]], tuple[list[list[dict[str, str]]], RegenerationStats]]


def cache_key(
    messages: list[dict[str, str]],
    fingerprint: str,
    temperature: float,
    max_new_tokens: int,
    max_len: int,
    seed: int,
    generator: str,
) -> str:
    """The cache file name of one conversation's regeneration.

    ``generator`` names the back end and its dtype (``hf-float32``, ``vllm-bfloat16``): a bf16 engine
    writes different replies from an fp32 one, so switching back end or dtype must not reuse them.
    """
    payload = json.dumps([fingerprint, temperature, max_new_tokens, max_len, seed, generator, messages], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class ReplyEngine:
    """What a regeneration task runs on: the verifier as a reply generator, and its tokenizer."""

    generate: ReplyGenerator
    tokenizer: Any


@dataclass(frozen=True)
class RegenerationTask:
    """One batch of conversations to regenerate.

    Attributes:
        start: The batch's first position among the conversations to regenerate (it seeds each turn).
        histories: The batch's conversations, each a list of messages.
        params: The prepare params (``max_len``, ``seed``, ``reasoning``).
    """

    start: int
    histories: list[list[dict[str, str]]]
    params: PrepareParams

    @property
    def label(self) -> str:
        return f"regeneration of conversations {self.start}..{self.start + len(self.histories) - 1}"


@dataclass(frozen=True)
class BatchResult:
    """A regenerated batch: its conversations, and the turns and tokens the verifier wrote."""

    histories: list[list[dict[str, str]]]
    turns: int
    tokens: int


def regenerate_batch(engine: ReplyEngine, task: RegenerationTask) -> BatchResult:
    """Every assistant turn of the batch's conversations rewritten, turn by turn, by ``engine``."""
    params, tokenizer = task.params, engine.tokenizer
    chat_kwargs = chat_template_kwargs(params.reasoning)
    histories = [[dict(m) for m in history] for history in task.histories]
    turns = tokens = 0
    longest = max(len(h) for h in histories)
    for turn in range(1, longest):
        rows = [b for b, h in enumerate(histories) if turn < len(h) and h[turn]["role"] == "assistant"]
        prompts = []
        for b in rows:
            text = tokenizer.apply_chat_template(
                histories[b][:turn], tokenize=False, add_generation_prompt=True, **chat_kwargs
            )
            prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        # A turn whose context already fills max_len would be truncated away: keep it as it is.
        pairs = [(b, p) for b, p in zip(rows, prompts, strict=True) if len(p) < params.max_len]
        if not pairs:
            continue
        replies = engine.generate([p for _, p in pairs], params.seed + task.start + turn)
        for (b, _), reply in zip(pairs, replies, strict=True):
            turns += 1
            tokens += len(reply)
            text = tokenizer.decode(reply, skip_special_tokens=True).strip()
            histories[b][turn]["content"] = strip_reasoning(text) if params.reasoning == "strip" else text
            histories[b][turn].pop("reasoning_content", None)  # the data set's thinking, not the verifier's
    return BatchResult(histories, turns, tokens)


@dataclass(frozen=True)
class ReplySettings:
    """What a Ray actor builds its :class:`ReplyEngine` from (picklable).

    Attributes:
        params: The prepare params (``regenerate_*``).
        info: The verifier stage's record.
        model_dir: The verifier's weights, an absolute path (the same on every node).
        eos_ids: Token ids that end an assistant turn.
    """

    params: PrepareParams
    info: VerifierInfo
    model_dir: Path
    eos_ids: frozenset[int]


def make_reply_engine(settings: ReplySettings) -> ReplyEngine:
    """Loads the tokenizer and the verifier on ``prepare.regenerate_backend`` (in a Ray actor)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(settings.model_dir, trust_remote_code=settings.info.trust_remote_code)
    job = GeneratorJob(settings.params, settings.info, settings.model_dir, tokenizer, set(settings.eos_ids))
    return ReplyEngine(BACKENDS.get(settings.params.regenerate_backend).load(job), tokenizer)


@dataclass(frozen=True)
class Pool:
    """Where regeneration runs (the cluster params), and what an engine outside this process is built from."""

    cluster: ClusterParams
    settings: ReplySettings


def regenerate(
    conversations: list[list[dict[str, str]]],
    generate_replies: ReplyGenerator | None,
    tokenizer: Any,
    params: PrepareParams,
    *,
    fingerprint: str,
    generator: str = "hf-float32",
    cache_dir: Path = CACHE_ROOT,
    pool: Pool | None = None,
) -> tuple[list[list[dict[str, str]]], RegenerationStats]:
    """The conversations with every assistant turn (after the first message) rewritten by the verifier.

    Args:
        conversations: The conversations, each a list of messages.
        generate_replies: The back end in this process; may be None when every conversation is already cached, or
            with ``pool``.
        tokenizer: The verifier's tokenizer.
        params: The prepare params: ``regenerate_temperature``, ``regenerate_max_new_tokens``, ``max_len``,
            ``regenerate_batch_size``, ``seed`` and ``reasoning`` (prompts are rendered with its chat-template
            switch: thinking on for ``keep``, off for ``strip``; with ``strip`` any thinking the verifier wrote
            anyway is removed from its reply).
        fingerprint: The verifier's fingerprint, part of every cache key.
        generator: The back end and its dtype (``hf-float32``, ``vllm-bfloat16``), part of every cache key.
        cache_dir: Where regenerated conversations are cached.
        pool: Run the batches where ``pool.cluster`` says; None: in this process.
    """
    cache_dir = checkout_path(cache_dir)  # the checkout's cache, also from a queued experiment's copy
    temperature, max_new_tokens = params.regenerate_temperature, params.regenerate_max_new_tokens
    if params.reasoning is not None:  # replies with and without thinking must never share a cache entry
        generator = f"{generator}-reasoning-{params.reasoning}"
    stats = RegenerationStats()
    started = time.perf_counter()
    results: list[list[dict[str, str]] | None] = [None] * len(conversations)
    keys = [
        cache_key(c, fingerprint, temperature, max_new_tokens, params.max_len, params.seed, generator)
        for c in conversations
    ]
    todo = []
    for i, key in enumerate(keys):
        cached = cache_dir / f"{key}.json"
        if cached.is_file():
            results[i] = json.loads(cached.read_text())
            stats.cache_hits += 1
        else:
            todo.append(i)
    if todo and generate_replies is None and pool is None:
        raise ValueError("regenerate: conversations to generate but no reply generator")
    # Batch conversations of similar length: a batch is left-padded to its longest prompt, so one long prompt
    # among short ones makes every row of its batch pay for the padding.
    todo.sort(key=lambda i: sum(len(m["content"]) for m in conversations[i][:-1]))
    size = params.regenerate_batch_size
    batches = {start: todo[start : start + size] for start in range(0, len(todo), size)}
    tasks = [RegenerationTask(start, [conversations[i] for i in batch], params) for start, batch in batches.items()]
    meter = progress(len(todo), "regenerated", "conv")  # per batch: the overall rate and ETA

    def on_result(task: RegenerationTask, result: BatchResult) -> None:
        stats.turns += result.turns
        stats.tokens += result.tokens
        for i, history in zip(batches[task.start], result.histories, strict=True):
            results[i] = history
            atomic_write_json(cache_dir / f"{keys[i]}.json", history)
        meter.update(len(result.histories))

    if tasks:
        cluster = pool.cluster if pool is not None else ClusterParams()
        with open_executor(cluster, regeneration_needs(params)) as executor:
            make_engine = reply_engine_maker(executor, generate_replies, tokenizer, pool)
            executor.run(make_engine, regenerate_batch, tasks, on_result)
    meter.close()
    stats.seconds = time.perf_counter() - started
    return [r for r in results if r is not None], stats


def reply_engine_maker(
    executor: Executor[Any, Any, Any], generate_replies: ReplyGenerator | None, tokenizer: Any, pool: Pool | None
) -> Callable[[], ReplyEngine]:
    """How ``executor``'s engines come to be: in this process, the verifier the stage loads (once, also for the
    prompts of ``builtin:self-instruct``); elsewhere, each engine loads its own from ``pool.settings``."""
    if executor.runs_in_driver:
        if generate_replies is None:
            raise ValueError("regenerate: conversations to generate but no reply generator")
        engine = ReplyEngine(generate_replies, tokenizer)
        return lambda: engine
    if pool is None:
        raise ValueError("regenerate: engines outside this process, but no settings to build them from")
    return functools.partial(make_reply_engine, pool.settings)


def regeneration_needs(params: PrepareParams) -> EngineNeeds:
    """What one regeneration engine takes from a node: the hf back end runs on CPUs (float32)."""
    if params.regenerate_backend == "vllm":
        return EngineNeeds(params.regenerate_vllm.tensor_parallel_size, "prepare.regenerate_vllm.tensor_parallel_size")
    return EngineNeeds(None, "prepare.regenerate_backend")


@dataclass(frozen=True)
class VerifierGenerator:
    """The verifier as the prepare stage's text generator, loaded on first use.

    Attributes:
        generate: Prompts -> completions on ``prepare.regenerate_backend``; the verifier loads on the first call,
            so a fully cached rerun never loads it.
        name: The back end and its dtype (``hf-float32``, ``vllm-bfloat16``), part of every cache key.
        regenerate: Conversations -> the same with every assistant turn rewritten (:func:`regenerate`).
    """

    generate: ReplyGenerator
    name: str
    regenerate: Regenerator


BACKENDS: Registry[ReplyBackend] = Registry("regeneration back end")


def _load_hf(job: GeneratorJob) -> ReplyGenerator:
    from eaglenest.stages.prepare.regenerate.hf import load_hf_generator

    return load_hf_generator(job)


def _load_vllm(job: GeneratorJob) -> ReplyGenerator:
    from eaglenest.stages.prepare.regenerate.vllm import vllm_reply_generator  # imports vllm once its engine starts

    return vllm_reply_generator(job)


BACKENDS.register("hf", ReplyBackend(dtype=lambda job: "float32", load=_load_hf))
BACKENDS.register(
    "vllm",
    ReplyBackend(dtype=lambda job: serving_dtype(job.model_dir, job.params.regenerate_vllm.dtype), load=_load_vllm),
)


def verifier_generator(
    params: PrepareParams,
    info: VerifierInfo,
    model_dir: Path,
    tokenizer: Any,
    eos_ids: set[int],
    cluster: ClusterParams | None = None,
) -> VerifierGenerator:
    """The prepare stage's generator on ``prepare.regenerate_backend``: it loads the verifier only when some
    conversation or prompt is not cached; regeneration runs where ``cluster.executor`` says (the prompts of
    ``builtin:self-instruct`` are always written in this process)."""
    job = GeneratorJob(params, info, model_dir, tokenizer, eos_ids)
    backend = BACKENDS.get(params.regenerate_backend)
    load = functools.cache(lambda: backend.load(job))  # a fully cached rerun never loads the verifier

    def generate_replies(prompts: list[list[int]], seed: int, sampling: Sampling | None = None) -> list[list[int]]:
        return load()(prompts, seed, sampling)

    generator = f"{params.regenerate_backend}-{backend.dtype(job)}"
    pool = None
    if cluster is not None:
        check_cluster(cluster)  # before any work: a cluster that is not there is one line
        pool = Pool(cluster, ReplySettings(params, info, Path(model_dir).resolve(), frozenset(eos_ids)))

    def run(conversations: list[list[dict[str, str]]]) -> tuple[list[list[dict[str, str]]], RegenerationStats]:
        return regenerate(
            conversations,
            generate_replies,
            tokenizer,
            params,
            fingerprint=info.fingerprint,
            generator=generator,
            pool=pool,
        )

    return VerifierGenerator(generate=generate_replies, name=generator, regenerate=run)
