"""The engines a measurement times: plain, the draft (EAGLE-3 and the other methods vLLM serves a speculators
checkpoint with) and vLLM's free drafters (n-gram drafting, suffix decoding), built from one engine params section,
started, warmed and stopped; and the K they run at.

The engines of one measurement start from one set of kwargs (:meth:`EngineBase.kwargs`) and differ only in what
drafting adds (:func:`drafting`: ``speculative_config`` and the per-request counts vLLM gives only with it): the
same ``max_num_seqs``, KV cache and stats logging, so no engine is timed under conditions another is spared. Those
kwargs are sized to the prompts the engines are given: ``max_model_len`` is the longest request (prompt,
``max_new_tokens``, K+1 draft slots at the largest K) and, on the CPU build, the KV cache holds the longest
requests an engine runs at once (``in_flight``, which also caps vLLM's ``max_num_seqs``), not
``VLLM_CPU_KVCACHE_SPACE``'s whole GiBs: evaluate holds three engines at once. No engine keeps a prefix cache, so a
timed prompt's prefill is timed, as a new chat turn meets a server.

On the CPU build every engine runs its engine core in this process (``in_process_on_cpu``: about 8 s to start
instead of about 25 s in processes of its own), however many a measurement starts. Every function takes ``param``,
the params key that asked for vLLM, named in every error.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eaglenest.core.errors import EaglenestError
from eaglenest.core.vllm_support import VLLM_NGRAM_WINDOW, VerifierTraits, create_llm, engine_kwargs, generate

if TYPE_CHECKING:
    from eaglenest.core.params import VllmEngineParams

WARM_UP_TOKENS = 16
# Requests a batched engine runs at once where its KV cache is sized (the CPU build): every request in flight holds
# its cache, three engines are up at once, and past a few dozen a verifier's batched step on a few cores gains little.
BATCH_IN_FLIGHT = 32


def requested_k(given: int | None, own: int, given_name: str) -> int:
    """K, the drafts per verify step: ``given`` where set, else the draft's ``own`` (``train.ttt_steps``).

    Raises:
        EaglenestError: ``given`` below 1, naming ``given_name`` (the flag or param that said it).
    """
    if given is None:
        return own
    if given < 1:
        raise EaglenestError(f"{given_name} {given}: must be at least 1 (the draft's own K is {own})")
    return given


def request_tokens(prompt_tokens: int, max_new_tokens: int, k: int) -> int:
    """The most tokens one request reaches: its prompt, its answer and the K+1 slots of the last verify step."""
    return prompt_tokens + max_new_tokens + k + 1


def kv_tokens(requests: list[int], in_flight: int) -> int:
    """The tokens a KV cache holds for ``requests`` (each one's :func:`request_tokens`) run ``in_flight`` at once:
    the sum of the largest ``in_flight`` of them."""
    return sum(sorted(requests, reverse=True)[: max(in_flight, 1)])


@dataclass(frozen=True)
class EngineBase:
    """What every engine of one measurement shares.

    Attributes:
        model_dir: The verifier's weights.
        verifier: The verifier stage's record (remote code, context length).
        engine: The engine params section (``evaluate.vllm``): dtype, GPU memory share, tensor-parallel width.
        seed: The engines' seed.
        at_once: Engines holding GPU memory at the same time; each takes that part of
            ``engine.gpu_memory_utilization``.
    """

    model_dir: Path
    verifier: VerifierTraits
    engine: VllmEngineParams
    seed: int
    at_once: int

    def kwargs(self, requests: list[int], in_flight: int = 1, batches: list[list[int]] | None = None) -> dict[str, Any]:
        """The ``vllm.LLM(**kwargs)`` every engine of one measurement starts from: plain decoding, with vLLM's stats
        logged. A drafting engine adds only its ``speculative_config`` (:func:`drafting`), so plain, draft and n-gram
        engines run with the same ``max_num_seqs``, KV cache and stats logging: what one engine is timed with, the
        others are too.

        Args:
            requests: The most tokens each request any of the engines will run reaches (:func:`request_tokens`,
                at the largest K among them).
            in_flight: Requests an engine runs at once (1: timed one prompt at a time).
            batches: Where the requests are decoded in several ``generate`` calls, the requests of each: the
                cache holds the largest ``in_flight`` of one call's; None: of all of them.
        """
        in_flight = max(1, min(in_flight, max(len(batch) for batch in batches or [requests])))
        held = max(kv_tokens(batch, in_flight) for batch in batches or [requests])
        # Stats logged on every engine, plain too: vLLM's logging costs each engine the same, so it cancels in a
        # speed-up, and the drafting engines' counters are read from it.
        return {
            **engine_kwargs(
                self.model_dir,
                self.verifier,
                self.engine,
                context_tokens=max(requests),
                seed=self.seed,
                gpu_memory_share=1 / self.at_once,
                kv_tokens=held,
                in_flight=in_flight,
            ),
            "enable_prefix_caching": False,
            "disable_log_stats": False,
        }


# What a drafting engine's kwargs add to the measurement's common ones (:meth:`EngineBase.kwargs`): its
# ``speculative_config``, and the per-request counts the figures are read from, which vLLM refuses without one.
DRAFTING_KEYS = ("speculative_config", "per_request_spec_decode_metrics")


def drafting(common: dict[str, Any], speculative_config: dict[str, Any] | None) -> dict[str, Any]:
    """One engine's kwargs: the measurement's ``common`` ones, plus ``speculative_config`` (the draft's,
    :func:`eaglenest.artifacts.draft.vllm_speculative_config`, or :func:`ngram_config`'s) and its per-request
    counts; None: plain decoding, ``common`` as it is."""
    if speculative_config is None:
        return dict(common)
    return {**common, "speculative_config": speculative_config, "per_request_spec_decode_metrics": "summary"}


@dataclass(frozen=True)
class NgramSetting:
    """vLLM's n-gram drafting (prompt lookup) as one engine runs it: the lookup window and K.

    Attributes:
        prompt_lookup_min: The shortest suffix of the sequence so far that is looked up.
        prompt_lookup_max: The longest; vLLM drafts after the longest match within the window.
        k: Tokens drafted per verify step.
    """

    prompt_lookup_min: int
    prompt_lookup_max: int
    k: int

    @classmethod
    def vllm_default(cls, k: int) -> NgramSetting:
        """vLLM's default window (what a user gets by naming the method) at K = ``k``."""
        return cls(*VLLM_NGRAM_WINDOW, k)

    def speculative_config(self) -> dict[str, Any]:
        """vLLM's ``speculative_config`` for it."""
        return {
            "method": "ngram",
            "num_speculative_tokens": self.k,
            "prompt_lookup_min": self.prompt_lookup_min,
            "prompt_lookup_max": self.prompt_lookup_max,
        }

    @property
    def label(self) -> str:
        """``window min:max, K = k``, as records and logs name it."""
        return f"window {self.prompt_lookup_min}:{self.prompt_lookup_max}, K = {self.k}"


@dataclass(frozen=True)
class SuffixSetting:
    """vLLM's suffix decoding (``method: suffix``, Arctic Inference's suffix trees over the request's prompt and
    output and over earlier requests' outputs) as one engine runs it.

    Attributes:
        max_tree_depth: The longest suffix of the sequence so far that is matched (and the trees' depth).
        max_spec_factor: Tokens proposed per matched token at most (a longer match proposes more).
        min_token_prob: The least estimated probability of a proposed token; the proposal stops before one below.
        k: The most tokens proposed per verify step.
    """

    max_tree_depth: int
    max_spec_factor: float
    min_token_prob: float
    k: int

    def speculative_config(self) -> dict[str, Any]:
        """vLLM's ``speculative_config`` for it."""
        return {
            "method": "suffix",
            "num_speculative_tokens": self.k,
            "suffix_decoding_max_tree_depth": self.max_tree_depth,
            "suffix_decoding_max_spec_factor": self.max_spec_factor,
            "suffix_decoding_min_token_prob": self.min_token_prob,
        }

    @property
    def label(self) -> str:
        """``depth d, factor f, min p, K = k``, as records and logs name it."""
        return (
            f"depth {self.max_tree_depth}, factor {self.max_spec_factor:g}, min p {self.min_token_prob:g}, K = {self.k}"
        )


def start_engine(
    kwargs: dict[str, Any], param: str, what: str, warm_up: list[int], seed: int, shapes: list[list[int]] | None = None
) -> tuple[Any, float]:
    """One engine, its core in this process on the CPU build, warmed up on ``warm_up`` (a prompt not timed: first
    forwards allocate and pick kernels), then given each of ``shapes`` (:func:`meet_shapes`); and its seconds to
    start."""
    started = time.perf_counter()
    llm = create_llm(kwargs, param, what=what, in_process_on_cpu=True)
    generate(llm, [{"prompt_token_ids": warm_up}], sampling_params(WARM_UP_TOKENS, 0.0, seed), param)
    meet_shapes(llm, shapes or [], seed, param)
    return llm, round(time.perf_counter() - started, 3)


def meet_shapes(llm: Any, prompts: list[list[int]], seed: int, param: str) -> None:
    """Each prompt alone for one token: the kernels for a prompt length are set up the first time the process meets
    it, which would otherwise fall on whichever engine is timed on it first."""
    for prompt in prompts:
        generate(llm, [{"prompt_token_ids": prompt}], sampling_params(1, 0.0, seed), param)


def sampling_params(max_tokens: int, temperature: float, seed: int, **extra: Any) -> Any:
    """vLLM's ``SamplingParams``, one seed per request: a sampled set decodes the same in every run, whatever else is
    in the batch (``extra``: more of its arguments, as ``logprobs``). Call it once an engine has started
    (:func:`~eaglenest.core.vllm_support.create_llm` checks the build)."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, **extra)


def engine_dtype(llm: Any, requested: str) -> str:
    """The dtype the engine actually runs in ("float32", "bfloat16", ...), from its model config."""
    dtype = getattr(getattr(getattr(llm, "llm_engine", None), "model_config", None), "dtype", None)
    return str(dtype).removeprefix("torch.") if dtype is not None else requested


def stop_engine(llm: Any) -> None:
    """Stops a vLLM engine a measurement started (:func:`start_engine`): its core (its process, on the
    multiprocessing client) is shut down and its memory collected, so the next engine has it."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if client is not None:
        client.shutdown()
    del llm
    gc.collect()
