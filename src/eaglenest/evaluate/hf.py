"""The ``hf`` evaluate back end: eaglenest's reference speculative decoder (:mod:`eaglenest.evaluate.speculative`)
against transformers' own ``generate``, in float32 on the CPU or one GPU.

``generate`` is the plain reference: its output is what speculative decoding must reproduce token for token
at temperature 0, and its speed is the baseline. It shares no code with the speculative decoder (cache,
runner, sampling), so a bug in either shows as a lossless failure.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from eaglenest.chat import cut_after_end_of_turn, end_of_turn_ids
from eaglenest.errors import EaglenestError, InputFileError
from eaglenest.evaluate.acceptance import total
from eaglenest.evaluate.job import EvaluationJob, Timed, set_metrics
from eaglenest.evaluate.speculative import EagleDrafter, VerifierRunner, speculative_decode
from eaglenest.hidden_states import read_header
from eaglenest.params import EvaluateParams
from eaglenest.verifier import load_tokenizer, load_verifier_info, register_remote_config


def load_draft(draft_dir: Path, model_dir: Path, trust_remote_code: bool = False) -> Any:
    """The trained draft, with its verifier pointed at the local weights (the recorded name is a server's)."""
    from speculators import SpeculatorModelConfig
    from speculators.models.eagle3 import Eagle3DraftModel

    if trust_remote_code:
        register_remote_config(model_dir)

    try:
        config = SpeculatorModelConfig.from_pretrained(str(draft_dir))
    except (OSError, ValueError) as err:
        raise EaglenestError(f"{draft_dir}: not a readable speculators checkpoint: {err}") from None
    config.speculators_config.verifier.name_or_path = str(model_dir)
    config.transformer_layer_config._attn_implementation = "sdpa"  # noqa: SLF001 (explicit masks below)
    _check_draft_weights(draft_dir, Eagle3DraftModel(config))
    model = Eagle3DraftModel.from_pretrained(str(draft_dir), config=config)
    model.load_verifier_weights()  # fills anything the checkpoint leaves out (NaN-initialised otherwise)
    for name in ("embed_tokens.weight", "lm_head.weight", "fc.weight"):
        if not torch.isfinite(model.state_dict()[name]).all():
            raise EaglenestError(f"{draft_dir}: {name} was not loaded (non-finite values)")
    return model.float().eval()


def _check_draft_weights(draft_dir: Path, expected_model: Any) -> None:
    """Every tensor the draft needs is in the checkpoint with its shape.

    speculators' from_pretrained leaves a missing or renamed weight at its random initial value without a
    word, so the file is checked against the model's own state dict first.
    """
    weights = draft_dir / "model.safetensors"
    try:
        header = read_header(weights)
    except FileNotFoundError:
        raise InputFileError(f"{weights}: missing; run `dvc repro train`") from None
    except (OSError, ValueError) as err:
        raise InputFileError(f"{weights}: not a safetensors file: {err}") from None
    if header.actual_size != header.expected_size:
        raise InputFileError(f"{weights}: truncated ({header.actual_size} of {header.expected_size} bytes)")
    skipped = set(getattr(expected_model, "_keys_to_ignore_on_save", None) or [])
    for name, tensor in expected_model.state_dict().items():
        if name in skipped:
            continue
        if name not in header.tensors:
            raise InputFileError(f"{weights}: missing tensor {name} {list(tensor.shape)}")
        if header.tensors[name][1] != list(tensor.shape):
            raise InputFileError(
                f"{weights}: tensor {name} has shape {header.tensors[name][1]}, expected {list(tensor.shape)}"
            )


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
