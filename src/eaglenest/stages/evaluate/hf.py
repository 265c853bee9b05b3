"""The ``hf`` evaluate back end: eaglenest's reference speculative decoder
(:mod:`eaglenest.stages.evaluate.speculative`) against transformers' own ``generate``, in float32 on the CPU or one GPU.

``generate`` is the plain reference: its output is what speculative decoding must reproduce token for token
at temperature 0, and its speed is the baseline. It shares no code with the speculative decoder (cache,
runner, sampling), so a bug in either shows as a lossless failure.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from eaglenest.artifacts.draft import load_draft
from eaglenest.artifacts.verifier import load_tokenizer, load_verifier_info
from eaglenest.core.chat import cut_after_end_of_turn, end_of_turn_ids
from eaglenest.core.params import EvaluateParams
from eaglenest.stages.evaluate.acceptance import total
from eaglenest.stages.evaluate.job import EvaluationJob, Timed, set_metrics
from eaglenest.stages.evaluate.speculative import EagleDrafter, VerifierRunner, speculative_decode


def evaluate_draft_hf(job: EvaluationJob) -> dict[str, dict[str, Any]]:
    """Speculative decoding against transformers' own ``generate`` on each prompt set; metrics per set."""
    from transformers import AutoModelForCausalLM

    params, verifier_dir, draft_dir = job.params, job.verifier_dir, job.draft_dir
    info, model_dir = load_verifier_info(verifier_dir)
    tokenizer = load_tokenizer(verifier_dir)
    draft = load_draft(draft_dir, model_dir, info.trust_remote_code)
    k = params.num_speculative_tokens or int(
        draft.config.speculators_config.proposal_methods[0].speculative_tokens)
    verifier_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                          trust_remote_code=info.trust_remote_code).eval()
    verifier = VerifierRunner(verifier_model, info.aux_layers)
    drafter = EagleDrafter(draft, info.vocab_size)
    eos = end_of_turn_ids(tokenizer, model_dir)
    generator = torch.Generator().manual_seed(params.seed)

    # Warm-up: the first forward passes allocate and pick kernels; keep them out of every timing.
    first = next(iter(job.prompt_sets.values()))[0]
    speculative_decode(verifier, drafter, first, k, min(8, params.max_new_tokens), eos)
    _hf_generate(verifier_model, first, params, eos, tokenizer, min(8, params.max_new_tokens))
    return {name: _evaluate_set_hf(job, prompts, verifier, verifier_model, drafter, tokenizer, eos, k, generator)
            for name, prompts in job.prompt_sets.items()}


def _evaluate_set_hf(job: EvaluationJob, prompts: list[list[int]], verifier: VerifierRunner, verifier_model: Any,
                     drafter: EagleDrafter, tokenizer: Any, eos: set[int], k: int, generator: torch.Generator
                     ) -> dict[str, Any]:
    """One prompt set: each prompt decoded alone by ``generate`` (the plain reference, tokens and time) and
    by speculative decoding."""
    params = job.params
    plains, specs = [], []
    for prompt in prompts:
        plains.append(_hf_generate(verifier_model, prompt, params, eos, tokenizer))
        specs.append(speculative_decode(verifier, drafter, prompt, k, params.max_new_tokens, eos, params.temperature,
                                        generator))
    plain = Timed([tokens for tokens, _ in plains], sum(seconds for _, seconds in plains))
    spec = Timed([s.tokens for s in specs], sum(s.seconds for s in specs))
    # float32: the exact lossless rule
    return set_metrics(job, prompts, k, total([s.acceptance for s in specs], k), plain, spec, backend="hf",
                       dtype="float32")


def _hf_generate(model: Any, prompt: list[int], params: EvaluateParams, eos: set[int], tokenizer: Any,
                 max_new_tokens: int | None = None) -> tuple[list[int], float]:
    """transformers' own ``generate()``, one prompt: (tokens up to the first end-of-turn, seconds).

    It is the plain reference: speculative decoding shares none of its code (cache, runner, sampling).
    """
    started = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens or params.max_new_tokens, do_sample=params.temperature > 0,
            temperature=params.temperature if params.temperature > 0 else None, top_k=None, top_p=None,
            eos_token_id=sorted(eos), pad_token_id=tokenizer.pad_token_id or sorted(eos)[0],
        )
    seconds = time.perf_counter() - started
    return cut_after_end_of_turn(output[0, len(prompt):].tolist(), eos), seconds
