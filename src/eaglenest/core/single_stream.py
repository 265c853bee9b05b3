"""Single-stream timing with vLLM: engines started and warmed, then each prompt decoded alone by every engine in
turn, as a chat user meets a server. The k_sweep stage times with it; evaluate's vllm back end
(``eaglenest.stages.evaluate.vllm``) holds its own copies of these functions until its next measured run adopts
them.

Engines share this process where the CPU build allows it (``in_process_on_cpu``: about 8 s to start instead of
about 25 s), which is at most three per process (a fourth fails registering its kernel overrides again); the
engines after the third run their engine core in processes of their own. Every function takes ``param``, the
params key that asked for vLLM, named in every error.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from eaglenest.core.eval_params import EvaluateParams
from eaglenest.core.progress import progress
from eaglenest.core.vllm_support import VLLM_NGRAM_WINDOW, create_llm, generate

# The CPU build starts at most this many engines in one process (core/vllm_support.create_llm).
IN_PROCESS_ENGINES = 3
WARM_UP_TOKENS = 16

_started_in_process = 0


def start_engine(kwargs: dict[str, Any], param: str, what: str, warm_up: list[int], seed: int,
                 shapes: list[list[int]] | None = None) -> tuple[Any, float]:
    """One engine, warmed up on ``warm_up`` (a prompt not timed: first forwards allocate and pick kernels), then
    given each of ``shapes`` alone for one token (the timed prompts: the kernels for a prompt length are set up the
    first time the process meets it, which would otherwise fall on whichever engine is timed on it first); and its
    seconds to start. Time only engines without a prefix cache after this, or the timed turns' prefills are cached.

    In this process while fewer than :data:`IN_PROCESS_ENGINES` have started in it, else in its own processes.
    """
    global _started_in_process
    started = time.perf_counter()
    in_process = _started_in_process < IN_PROCESS_ENGINES
    llm = create_llm(kwargs, param, what=what, in_process_on_cpu=in_process)
    _started_in_process += in_process
    generate(llm, [{"prompt_token_ids": warm_up}], sampling_params(WARM_UP_TOKENS, 0.0, seed), param)
    for prompt in shapes or []:
        generate(llm, [{"prompt_token_ids": prompt}], sampling_params(1, 0.0, seed), param)
    return llm, round(time.perf_counter() - started, 3)


def sampling_params(max_tokens: int, temperature: float, seed: int, **extra: Any) -> Any:
    """vLLM's ``SamplingParams``, one seed per request: a sampled set decodes the same in every run, whatever else is
    in the batch (``extra``: more of its arguments, as ``logprobs``). Call it once an engine has started
    (:func:`~eaglenest.core.vllm_support.create_llm` checks the build)."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, **extra)


def speculative_engine_kwargs(speculative_config: dict[str, Any]) -> dict[str, Any]:
    """A speculative engine's ``vllm.LLM`` arguments beyond the shared ones: its method, with per-request counts."""
    return {"disable_log_stats": False, "per_request_spec_decode_metrics": "summary",
            "speculative_config": speculative_config}


def close_engine(llm: Any) -> None:
    """Stops an engine's core (its process, on the multiprocessing client) so the next one has the memory."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if client is not None:
        client.shutdown()
    del llm
    gc.collect()


def time_interleaved(engines: dict[str, Any], prompts: list[list[int]], sampling: Any, param: str,
                     progress_desc: str) -> dict[str, list[tuple[Any, float]]]:
    """Each prompt alone on every engine, the engines taking turns prompt by prompt, the order rotating: a
    speed-up divides seconds measured moments apart, so the machine's drift between minutes cancels.

    Returns:
        ``{engine name: [(output, seconds), ...]}``, one pair per prompt, in the prompts' order.
    """
    names = list(engines)
    timed: dict[str, list[tuple[Any, float]]] = {name: [] for name in names}
    for i, prompt in enumerate(progress(len(prompts), progress_desc, "turn", iterable=prompts)):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            started = time.perf_counter()
            (output,) = generate(engines[name], [{"prompt_token_ids": prompt}], sampling, param)
            timed[name].append((output, time.perf_counter() - started))
    return timed


def drafted_steps(output: Any) -> tuple[int, int] | None:
    """(verify steps that had a draft, drafts accepted) of one request, from vLLM's per-request
    ``spec_decode_metrics`` (its histogram counts steps by drafts accepted); None where the build reports none."""
    metrics = getattr(output.outputs[0], "spec_decode_metrics", None)
    if metrics is None:
        return None
    histogram = list(metrics.histogram)  # [K + 1]
    return sum(histogram), sum(j * count for j, count in enumerate(histogram))


def ngram_config(params: EvaluateParams, k: int) -> tuple[dict[str, Any], tuple[int, int]]:
    """vLLM's n-gram ``speculative_config`` at the draft's K, and the lookup window it runs with."""
    low, high = params.ngram_prompt_lookup_min, params.ngram_prompt_lookup_max
    if low is None and high is None:
        low, high = VLLM_NGRAM_WINDOW
    low, high = low or 1, high or max(low or 1, VLLM_NGRAM_WINDOW[1])
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": low, "prompt_lookup_max": high}, (
        low, high)
