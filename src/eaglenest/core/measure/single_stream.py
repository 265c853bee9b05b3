"""Single-stream timing: each prompt decoded alone, as a chat user meets a server, on every engine in turn.

A speed-up divides two engines' seconds; timed minutes apart, they carry whatever the machine did in between (on a
shared 2-core CPU, a run's speed-up moved by 0.2 from it). Timed seconds apart, they share it: so the engines are up
at once and take turns prompt by prompt (:func:`time_interleaved`), the order rotating so that no engine is always
the one timed first after another's turn. The engines keep no prefix cache
(:meth:`eaglenest.core.measure.engines.EngineBase.kwargs`): every timed turn includes its prefill.
"""

from __future__ import annotations

import time
from typing import Any

from eaglenest.core.progress import progress
from eaglenest.core.vllm_support import generate

# One timed decoding: vLLM's output and its seconds.
Timed = tuple[Any, float]
# Seconds are recorded to the microsecond: a speed-up computed from the records is the one computed from the timing.
SECONDS_PLACES = 6


def decode_alone(llm: Any, prompts: list[list[int]], sampling: Any, param: str) -> list[Timed]:
    """Each prompt alone, one after the other: (output, seconds) each."""
    timed = []
    for prompt in prompts:
        started = time.perf_counter()
        (output,) = generate(llm, [{"prompt_token_ids": prompt}], sampling, param)
        timed.append((output, time.perf_counter() - started))
    return timed


def time_interleaved(
    engines: dict[str, Any], prompts: list[list[int]], sampling: Any, param: str, progress_desc: str
) -> dict[str, list[Timed]]:
    """Each prompt alone on every engine, the engines taking turns prompt by prompt, the order rotating.

    Returns:
        ``{engine name: [(output, seconds), ...]}``, one pair per prompt, in the prompts' order.
    """
    names = list(engines)
    timed: dict[str, list[Timed]] = {name: [] for name in names}
    for i, prompt in enumerate(progress(len(prompts), progress_desc, "turn", iterable=prompts)):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            timed[name] += decode_alone(engines[name], [prompt], sampling, param)
    return timed


def output_tokens(output: Any) -> list[int]:
    """The token ids a vLLM request output generated."""
    return list(output.outputs[0].token_ids)


def tokens_and_seconds(timed: list[Timed]) -> list[list[float]]:
    """``[tokens, seconds]`` of each timed decoding."""
    return [[len(output_tokens(output)), round(seconds, SECONDS_PLACES)] for output, seconds in timed]
