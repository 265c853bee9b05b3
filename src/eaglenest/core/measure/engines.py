"""The engines a measurement times: plain, the draft (EAGLE-3 and the other methods vLLM serves a speculators
checkpoint with) and vLLM's n-gram drafting, built from one engine params section, started, warmed and stopped; and
the K they run at.

Every engine is sized to the prompts it is given (:meth:`EngineBase.kwargs`): ``max_model_len`` is its longest
request (prompt, ``max_new_tokens``, K+1 draft slots) and, on the CPU build, its KV cache holds the longest
requests it runs at once (``in_flight``, which also caps vLLM's ``max_num_seqs``), not ``VLLM_CPU_KVCACHE_SPACE``'s
whole GiBs: evaluate holds three engines at once, and an engine timed one prompt at a time needs one request's
cache. No engine keeps a prefix cache, so a timed prompt's prefill is timed, as a new chat turn meets a server.

Engines share this process where the CPU build allows it (``in_process_on_cpu``: about 8 s to start instead of
about 25 s), which is at most three per process (a fourth fails registering its kernel overrides again); the
engines after the third run their engine core in processes of their own. Every function takes ``param``, the
params key that asked for vLLM, named in every error.
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
    from eaglenest.core.eval_params import EvalSetsAndEngines
    from eaglenest.core.params import VllmEngineParams

# The CPU build starts at most this many engines in one process (core/vllm_support.create_llm).
IN_PROCESS_ENGINES = 3
WARM_UP_TOKENS = 16
# Requests a batched engine runs at once where its KV cache is sized (the CPU build): every request in flight holds
# its cache, three engines are up at once, and past a few dozen a verifier's batched step on a few cores gains little.
BATCH_IN_FLIGHT = 32

_started_in_process = 0


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
    return sum(sorted(requests, reverse=True)[:max(in_flight, 1)])


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

    def kwargs(self, requests: list[int], in_flight: int = 1, speculative_config: dict[str, Any] | None = None,
               batches: list[list[int]] | None = None) -> dict[str, Any]:
        """``vllm.LLM(**kwargs)`` of one engine: plain, or drafting with ``speculative_config``.

        Args:
            requests: The most tokens each request it will run reaches (:func:`request_tokens`).
            in_flight: Requests it runs at once (1: timed one prompt at a time).
            speculative_config: vLLM's ``speculative_config`` (the draft's,
                :func:`eaglenest.artifacts.draft.vllm_speculative_config`, or :func:`ngram_config`'s); None: plain.
            batches: Where the requests are decoded in several ``generate`` calls, the requests of each: the
                cache holds the largest ``in_flight`` of one call's; None: of all of them.
        """
        in_flight = max(1, min(in_flight, max(len(batch) for batch in batches or [requests])))
        held = max(kv_tokens(batch, in_flight) for batch in batches or [requests])
        kwargs = {**engine_kwargs(self.model_dir, self.verifier, self.engine, context_tokens=max(requests),
                                  seed=self.seed, gpu_memory_share=1 / self.at_once, kv_tokens=held,
                                  in_flight=in_flight),
                  "enable_prefix_caching": False}
        if speculative_config is not None:
            # the stats and per-request counts the figures are read from
            kwargs |= {"disable_log_stats": False, "per_request_spec_decode_metrics": "summary",
                       "speculative_config": speculative_config}
        return kwargs


def ngram_config(params: EvalSetsAndEngines | None, k: int) -> tuple[dict[str, Any], tuple[int, int]]:
    """vLLM's n-gram ``speculative_config`` at K = ``k`` in evaluate's window (``params``; None: vLLM's default), and
    the lookup window it runs with."""
    low, high = (None, None) if params is None else (params.ngram_prompt_lookup_min, params.ngram_prompt_lookup_max)
    if low is None and high is None:
        low, high = VLLM_NGRAM_WINDOW
    low, high = low or 1, high or max(low or 1, VLLM_NGRAM_WINDOW[1])
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": low, "prompt_lookup_max": high}, (
        low, high)


def start_engine(kwargs: dict[str, Any], param: str, what: str, warm_up: list[int], seed: int,
                 shapes: list[list[int]] | None = None) -> tuple[Any, float]:
    """One engine, warmed up on ``warm_up`` (a prompt not timed: first forwards allocate and pick kernels), then
    given each of ``shapes`` (:func:`meet_shapes`); and its seconds to start.

    In this process while fewer than :data:`IN_PROCESS_ENGINES` have started in it, else in its own processes.
    """
    global _started_in_process
    started = time.perf_counter()
    in_process = _started_in_process < IN_PROCESS_ENGINES
    llm = create_llm(kwargs, param, what=what, in_process_on_cpu=in_process)
    _started_in_process += in_process
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


def close_engine(llm: Any) -> None:
    """Stops an engine's core (its process, on the multiprocessing client) so the next one has the memory."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if client is not None:
        client.shutdown()
    del llm
    gc.collect()
