"""The evaluate stage: the trained draft in real speculative decoding, against plain decoding.

Metrics (``metrics/eval.json``):

* ``tau`` — mean tokens emitted per verifier forward, vLLM's definition ``1 + accepted / verify_steps``;
  ``per_position_acceptance[i]`` — fraction of verify steps whose i-th draft was accepted;
  ``draft_acceptance_rate`` — accepted / drafted.
* ``identical_fraction`` — prompts whose speculative output equals plain decoding of the same engine in
  the same dtype token for token (every back end).
* ``lossless_fraction`` — prompts whose speculative output counts as lossless; at temperature 0 anything
  below 1.0 fails the stage. What counts depends on the arithmetic:

  - ``hf`` (always float32) and ``vllm`` with ``evaluate.vllm_dtype: float32``: exact token equality with
    plain greedy decoding, so ``lossless_fraction == identical_fraction``. In float32 the verify forward
    over K drafts picks the same argmax as K single-token forwards; any difference is a bug.
  - ``vllm`` below float32 (bfloat16, float16; ``auto`` on an fp32 checkpoint is bfloat16): a prompt is
    lossless if its speculative output is identical to plain, or if at the first position where they
    differ the token speculation emitted is among the plain run's top ``TIE_CANDIDATES`` there and its
    log-prob is at most ``evaluate.bf16_tie_margin`` below the plain run's top token. A verify forward
    over K+1 positions sums in a different order than a one-token forward, and bf16 rounding (about 3
    significant digits; bf16 log-probs of SmolLM2 come in steps of 0.0625–0.25) flips near-ties; a broken
    acceptance rule emits tokens far from the verifier's top choice. Tokens after the first difference
    follow a different context and are not compared. Measured on SmolLM2 (64 prompts, 32 tokens, bf16):
    27 of 64 outputs left plain decoding, every time at a gap of at most 0.25 (26 times plain's second
    choice, once its third).

* ``tokens_per_s_plain`` / ``tokens_per_s_spec`` / ``speedup`` — same process, same prompts, after a
  warm-up, each prompt decoded alone (single stream, as a chat user sees it). ``hf``: the plain figure is
  the faster of transformers' own ``generate`` and eaglenest's plain loop, so the speed-up is never
  flattered by a slow baseline. ``vllm`` also reports ``*_batched``: all prompts in one ``generate`` call.
* ``tau_ngram`` — prompt-lookup (n-gram) drafting with the same K on the same prompts: the baseline.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from eaglenest.atomic import atomic_write_json
from eaglenest.errors import EaglenestError, InputFileError
from eaglenest.lossless import lossless_counts
from eaglenest.params import EvaluateParams
from eaglenest.prepare import VAL_PROMPTS_FILE, end_of_turn_ids
from eaglenest.speculative import EagleDrafter, VerifierRunner, ngram_acceptance, plain_decode, speculative_decode
from eaglenest.verifier import load_tokenizer, load_verifier_info

log = logging.getLogger(__name__)


def load_prompts(params: EvaluateParams, prepared_dir: Path, tokenizer: Any) -> list[list[int]]:
    """Token ids of the evaluation prompts, rendered with the chat template and its generation prompt."""
    source = Path(params.prompts) if params.prompts else prepared_dir / VAL_PROMPTS_FILE
    try:
        lines = source.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise InputFileError(f"{source}: prompts file not found (evaluate.prompts)") from None
    except UnicodeDecodeError as err:
        raise InputFileError(f"{source}: not UTF-8 text ({err.reason})") from None
    prompts: list[list[int]] = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputFileError(f"{source}: line {line_no}: not valid JSON: {err.msg}") from None
        if isinstance(record, dict) and isinstance(record.get("messages"), list) and record["messages"]:
            text = tokenizer.apply_chat_template(record["messages"], tokenize=False, add_generation_prompt=True)
        elif isinstance(record, dict) and isinstance(record.get("prompt"), str) and record["prompt"].strip():
            text = tokenizer.apply_chat_template([{"role": "user", "content": record["prompt"]}], tokenize=False,
                                                 add_generation_prompt=True)
        else:
            raise InputFileError(
                f"{source}: line {line_no}: expected {{'messages': [...]}} or {{'prompt': '...'}}"
            )
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(prompts) == params.num_prompts:
            break
    if not prompts:
        raise InputFileError(f"{source}: no prompts (use evaluate.prompts, or prepare rows with conversations)")
    return prompts


def load_draft(draft_dir: Path, model_dir: Path) -> Any:
    """The trained draft, with its verifier pointed at the local weights (the recorded name is a server's)."""
    from speculators import SpeculatorModelConfig
    from speculators.models.eagle3 import Eagle3DraftModel

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
    from eaglenest.hidden_states import read_header

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


def summarize(k: int, verify_steps: int, accepted: int, per_position: list[int]) -> dict[str, Any]:
    """tau and acceptance rates from counts, as vLLM computes them."""
    return {
        "tau": round(1 + accepted / verify_steps, 4) if verify_steps else 1.0,
        "per_position_acceptance": [round(c / verify_steps, 4) if verify_steps else 0.0 for c in per_position],
        "draft_acceptance_rate": round(accepted / (k * verify_steps), 4) if verify_steps else 0.0,
        "verify_steps": verify_steps,
    }


def evaluate_draft_hf(params: EvaluateParams, verifier_dir: Path, prepared_dir: Path, draft_dir: Path
                      ) -> dict[str, Any]:
    """Speculative vs plain decoding with transformers; returns the metrics."""
    from transformers import AutoModelForCausalLM

    info, model_dir = load_verifier_info(verifier_dir)
    tokenizer = load_tokenizer(verifier_dir)
    prompts = load_prompts(params, prepared_dir, tokenizer)
    draft = load_draft(draft_dir, model_dir)
    k = params.num_speculative_tokens or int(
        draft.config.speculators_config.proposal_methods[0].speculative_tokens)
    verifier_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                          trust_remote_code=info.trust_remote_code).eval()
    verifier = VerifierRunner(verifier_model, info.aux_layers)
    drafter = EagleDrafter(draft, info.vocab_size)
    eos = end_of_turn_ids(tokenizer, model_dir)
    generator = torch.Generator().manual_seed(params.seed)

    # Warm-up: the first forward passes allocate and pick kernels; keep them out of every timing.
    speculative_decode(verifier, drafter, prompts[0], k, min(8, params.max_new_tokens), eos)
    plain_decode(verifier, prompts[0], min(8, params.max_new_tokens), eos)

    totals = {"plain_loop_s": 0.0, "generate_s": 0.0, "spec_s": 0.0, "plain_tokens": 0, "spec_tokens": 0,
              "generate_tokens": 0}
    steps = accepted = 0
    per_position = [0] * k
    ngram = [0, 0, [0] * k]
    plains: list[list[int]] = []
    specs: list[list[int]] = []
    for prompt in prompts:
        plain, plain_s = plain_decode(verifier, prompt, params.max_new_tokens, eos, params.temperature, generator)
        generated, generate_s = _hf_generate(verifier_model, prompt, params, eos, tokenizer)
        spec = speculative_decode(verifier, drafter, prompt, k, params.max_new_tokens, eos, params.temperature,
                                  generator)
        totals["plain_loop_s"] += plain_s
        totals["plain_tokens"] += len(plain)
        totals["generate_s"] += generate_s
        totals["generate_tokens"] += len(generated)
        totals["spec_s"] += spec.seconds
        totals["spec_tokens"] += len(spec.tokens)
        steps += spec.verify_steps
        accepted += spec.accepted
        per_position = [a + b for a, b in zip(per_position, spec.accepted_per_position, strict=True)]
        plains.append(plain)
        specs.append(spec.tokens)
        n_steps, n_accepted, n_per_position = ngram_acceptance(prompt, plain, k)
        ngram[0] += n_steps
        ngram[1] += n_accepted
        ngram[2] = [a + b for a, b in zip(ngram[2], n_per_position, strict=True)]

    plain_rate = max(totals["plain_tokens"] / totals["plain_loop_s"], totals["generate_tokens"] / totals["generate_s"])
    spec_rate = totals["spec_tokens"] / totals["spec_s"]
    baseline = summarize(k, ngram[0], ngram[1], ngram[2])
    metrics = {
        **summarize(k, steps, accepted, per_position),
        "tokens_per_s_plain": round(plain_rate, 2),
        "tokens_per_s_plain_loop": round(totals["plain_tokens"] / totals["plain_loop_s"], 2),
        "tokens_per_s_generate": round(totals["generate_tokens"] / totals["generate_s"], 2),
        "tokens_per_s_spec": round(spec_rate, 2),
        "speedup": round(spec_rate / plain_rate, 4),
        **lossless_counts(plains, specs, None, None),  # float32: the exact rule
        "lossless_rule": "exact",
        "tau_ngram": baseline["tau"],
        "per_position_acceptance_ngram": baseline["per_position_acceptance"],
        "num_speculative_tokens": k,
        "num_prompts": len(prompts),
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "dtype": "float32",
        "backend": "hf",
    }
    return metrics


def _hf_generate(model: Any, prompt: list[int], params: EvaluateParams, eos: set[int], tokenizer: Any
                 ) -> tuple[list[int], float]:
    """transformers' own generate(): the other plain baseline."""
    started = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=params.max_new_tokens, do_sample=params.temperature > 0,
            temperature=params.temperature if params.temperature > 0 else None, top_k=None, top_p=None,
            eos_token_id=sorted(eos), pad_token_id=tokenizer.pad_token_id or sorted(eos)[0],
        )
    return output[0, len(prompt):].tolist(), time.perf_counter() - started


def write_eval_outputs(metrics: dict[str, Any], metrics_path: Path, plots_dir: Path) -> None:
    """metrics/eval.json plus the two plot tables dvc.yaml declares."""
    # Lists again under flat names (acceptance_pos_1..K): `dvc metrics diff` shows scalars only.
    flat = {f"acceptance_pos_{i + 1}": rate for i, rate in enumerate(metrics["per_position_acceptance"])}
    atomic_write_json(metrics_path, {**metrics, **flat})
    acceptance = [
        {"position": i + 1, "drafter": name, "acceptance": rate}
        for name, rates in (("eagle3", metrics["per_position_acceptance"]),
                            ("ngram", metrics.get("per_position_acceptance_ngram", [])))
        for i, rate in enumerate(rates)
    ]
    atomic_write_json(plots_dir / "acceptance.json", acceptance)
    atomic_write_json(plots_dir / "tau.json", [
        {"drafter": "eagle3", "tau": metrics["tau"]},
        {"drafter": "ngram", "tau": metrics["tau_ngram"]},
        {"drafter": "upper bound (K+1)", "tau": metrics["num_speculative_tokens"] + 1},
    ])


def evaluate(params: EvaluateParams, verifier_dir: Path, prepared_dir: Path, draft_dir: Path, metrics_path: Path,
             plots_dir: Path) -> dict[str, Any]:
    """The evaluate stage."""
    if params.backend == "vllm":
        from eaglenest.evaluate_vllm import evaluate_draft_vllm

        metrics = evaluate_draft_vllm(params, verifier_dir, prepared_dir, draft_dir)
    else:
        metrics = evaluate_draft_hf(params, verifier_dir, prepared_dir, draft_dir)
    write_eval_outputs(metrics, metrics_path, plots_dir)
    log.info("tau %.3f (n-gram %.3f), speed-up %.3f, lossless %.2f", metrics["tau"], metrics["tau_ngram"],
             metrics["speedup"], metrics["lossless_fraction"])
    if params.temperature == 0 and metrics["lossless_fraction"] < 1.0:
        rule = ("identical tokens" if metrics.get("lossless_rule", "exact") == "exact" else
                f"identical, or a near-tie flipped within evaluate.bf16_tie_margin={params.bf16_tie_margin}")
        raise EaglenestError(
            f"lossless_fraction = {metrics['lossless_fraction']} < 1.0 at temperature 0 "
            f"(evaluate.backend: {metrics['backend']}, rule: {rule}): greedy speculative decoding left plain "
            f"greedy decoding on some of {metrics['num_prompts']} prompts: the verification (acceptance rule) is "
            f"wrong, whatever the draft; see divergence_gaps in {metrics_path}"
        )
    return metrics
