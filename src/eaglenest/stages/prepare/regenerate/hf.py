"""The ``hf`` regeneration back end: transformers ``generate`` with left padding and a KV cache, float32 on the
CPU (or a GPU): the reference the ``vllm`` back end is compared with."""

from __future__ import annotations

from typing import Any

import torch

from eaglenest.core.chat import cut_after_end_of_turn
from eaglenest.stages.prepare.regenerate.job import GeneratorJob, ReplyGenerator, Sampling


def load_hf_generator(job: GeneratorJob) -> ReplyGenerator:
    """Loads the verifier with transformers, in float32; returns the prompts -> replies function."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        job.model_dir, dtype=torch.float32, trust_remote_code=job.info.trust_remote_code
    ).eval()
    return hf_reply_generator(
        model, job.tokenizer, job.params.regenerate_temperature, job.params.regenerate_max_new_tokens, job.eos_ids
    )


def hf_reply_generator(
    model: Any, tokenizer: Any, temperature: float, max_new_tokens: int, eos_ids: set[int]
) -> ReplyGenerator:
    """The ``hf`` back end: transformers ``generate`` on the verifier already loaded."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)

    def generate_replies(prompts: list[list[int]], seed: int, sampling: Sampling | None = None) -> list[list[int]]:
        if sampling is not None:  # rows of one sampled batch differ: they draw from one generator in turn
            return _generate(prompts, model, pad_id, sampling.temperature, sampling.max_new_tokens, eos_ids, seed)
        return _generate(prompts, model, pad_id, temperature, max_new_tokens, eos_ids, seed)

    return generate_replies


def _generate(
    prompts: list[list[int]],
    model: Any,
    pad_id: int,
    temperature: float,
    max_new_tokens: int,
    eos_ids: set[int],
    seed: int,
) -> list[list[int]]:
    """Batched generation with left padding; each reply cut after its first end-of-turn token."""
    longest = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for i, prompt in enumerate(prompts):  # left padding: every prompt ends where generation starts
        input_ids[i, longest - len(prompt) :] = torch.tensor(prompt)
        attention_mask[i, longest - len(prompt) :] = 1
    torch.manual_seed(seed)
    with torch.inference_mode():
        output = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_k=None,
            top_p=None,
            eos_token_id=sorted(eos_ids),
            pad_token_id=pad_id,
        )
    return [cut_after_end_of_turn(row, eos_ids) for row in output[:, longest:].tolist()]
