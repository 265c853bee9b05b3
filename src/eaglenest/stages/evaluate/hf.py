"""The ``hf`` evaluate back end: eaglenest's reference speculative decoder
(:mod:`eaglenest.stages.evaluate.speculative`) against transformers' own ``generate``, in float32 on the CPU or one GPU.

``generate`` is the plain reference: its output is what speculative decoding must reproduce token for token
at temperature 0, and its speed is the baseline. It shares no code with the speculative decoder (cache,
runner, sampling), so a bug in either shows as a lossless failure. Every turn is decoded alone, so every
record is timed. With the vllm back end also listed, hf decodes only each set's first
``evaluate.reference_prompts`` conversations: it is the check, vllm the measurement.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from eaglenest.artifacts.draft import load_draft
from eaglenest.artifacts.eval_sets import EvalSet
from eaglenest.artifacts.verifier import load_tokenizer, load_verifier_info
from eaglenest.core.chat import cut_after_end_of_turn, end_of_turn_ids
from eaglenest.core.measure.engines import requested_k
from eaglenest.core.progress import progress
from eaglenest.stages.evaluate.job import EvaluationJob, add_free, add_timing, ask_turns, set_entry, turn_record
from eaglenest.stages.evaluate.ngram import ngram_acceptance
from eaglenest.stages.evaluate.speculative import EagleDrafter, VerifierRunner, speculative_decode

log = logging.getLogger(__name__)


def evaluate_draft_hf(job: EvaluationJob) -> dict[str, Any]:
    """Speculative decoding against transformers' own ``generate`` on each set; one record per turn."""
    from transformers import AutoModelForCausalLM

    params, verifier_dir, draft_dir = job.params, job.verifier_dir, job.draft_dir
    started = time.perf_counter()
    info, model_dir = load_verifier_info(verifier_dir)
    tokenizer = load_tokenizer(verifier_dir)
    draft = load_draft(draft_dir, model_dir, info.trust_remote_code)
    k = requested_k(
        params.num_speculative_tokens,
        int(draft.config.speculators_config.proposal_methods[0].speculative_tokens),
        "evaluate.num_speculative_tokens",
    )
    verifier_model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, trust_remote_code=info.trust_remote_code
    ).eval()
    decoder = ReferenceDecoder(
        VerifierRunner(verifier_model, info.aux_layers),
        verifier_model,
        EagleDrafter(draft, info.vocab_size),
        tokenizer,
        end_of_turn_ids(tokenizer, model_dir),
        k,
    )

    # Warm-up: the first forward passes allocate and pick kernels; keep them out of every timing.
    first = job.sets[0].render(job.sets[0].conversations[0], 0, [], tokenizer)
    decoder.plain(first, 8, 0.0)
    decoder.speculative(first, 8, 0.0, torch.Generator().manual_seed(params.seed))
    limit = params.reference_prompts if "vllm" in params.backends else None
    # Where the back end's time goes (seconds): loading both models with the warm-up, then each set.
    phases: dict[str, Any] = {"start": round(time.perf_counter() - started, 3), "sets": {}}
    sets = {}
    for eval_set in job.sets:
        started = time.perf_counter()
        sets[eval_set.name] = _evaluate_set_hf(eval_set, decoder, limit, params.seed)
        phases["sets"][eval_set.name] = round(time.perf_counter() - started, 3)
        log.info(
            "hf, %s: %d turns, plain and speculative, in %.0f s",
            eval_set.name,
            len(sets[eval_set.name]["records"]),
            time.perf_counter() - started,
        )
    return {"dtype": "float32", "num_speculative_tokens": k, "phases": phases, "sets": sets}


class ReferenceDecoder:
    """transformers' ``generate`` (plain) and the reference speculative decoder, on one verifier."""

    def __init__(
        self, verifier: VerifierRunner, model: Any, drafter: EagleDrafter, tokenizer: Any, eos: set[int], k: int
    ) -> None:
        self.verifier, self.model, self.drafter, self.tokenizer, self.eos, self.k = (
            verifier,
            model,
            drafter,
            tokenizer,
            eos,
            k,
        )

    def plain(self, prompt: list[int], max_new_tokens: int, temperature: float) -> tuple[list[int], float]:
        """transformers' own ``generate()``, one prompt: (tokens up to the first end-of-turn, seconds)."""
        started = time.perf_counter()
        with torch.inference_mode():
            output = self.model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None,
                top_k=None,
                top_p=None,
                eos_token_id=sorted(self.eos),
                pad_token_id=self.tokenizer.pad_token_id or sorted(self.eos)[0],
            )
        seconds = time.perf_counter() - started
        return cut_after_end_of_turn(output[0, len(prompt) :].tolist(), self.eos), seconds

    def speculative(
        self, prompt: list[int], max_new_tokens: int, temperature: float, generator: torch.Generator
    ) -> Any:
        return speculative_decode(
            self.verifier, self.drafter, prompt, self.k, max_new_tokens, self.eos, temperature, generator
        )


def _evaluate_set_hf(eval_set: EvalSet, decoder: ReferenceDecoder, limit: int | None, seed: int) -> dict[str, Any]:
    """One set: each turn decoded alone by ``generate`` (the plain reference, its tokens and time; later turns
    follow its answers) and by speculative decoding."""
    params = eval_set.params
    generator = torch.Generator().manual_seed(seed)
    turns, plains = ask_turns(
        eval_set,
        eval_set.conversations[:limit],
        decoder.tokenizer,
        lambda prompts: [decoder.plain(p, params.max_new_tokens, params.temperature) for p in prompts],
        lambda output: output[0],
    )
    records = []
    for item, (plain, plain_s) in progress(
        len(turns), f"hf speculative, {eval_set.name}", "turn", iterable=zip(turns, plains, strict=True)
    ):
        spec = decoder.speculative(item.prompt, params.max_new_tokens, params.temperature, generator)
        # float32: the exact lossless rule
        record = turn_record(item, spec.acceptance, plain, spec.tokens, check_lossless=params.temperature == 0)
        add_timing(record, "plain", len(plain), plain_s)
        add_timing(record, "spec", len(spec.tokens), spec.seconds)
        # The n-gram baseline replayed on the plain output (exact at temperature 0): its counts, no timing.
        add_free(record, ngram_acceptance(item.prompt, plain, decoder.k))
        records.append(record)
    return set_entry(eval_set, records, ngram="replayed prompt lookup (longest earlier match of up to 3 tokens)")
