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
from eaglenest.prepare import VAL_PROMPTS_FILE, cut_after_end_of_turn, end_of_turn_ids
from eaglenest.speculative import EagleDrafter, VerifierRunner, ngram_acceptance, speculative_decode
from eaglenest.verifier import load_tokenizer, load_verifier_info

log = logging.getLogger(__name__)


def load_prompts(source: Path, num_prompts: int, tokenizer: Any, param: str = "evaluate.prompts"
                 ) -> list[dict[str, Any]]:
    """The first ``num_prompts`` records of a prompts file, each ``{"messages", "token_ids"}``: the messages
    (a bare ``prompt`` becomes one user message) and their chat-template rendering with the generation prompt."""
    try:
        lines = source.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise InputFileError(f"{source}: prompts file not found ({param})") from None
    except UnicodeDecodeError as err:
        raise InputFileError(f"{source}: not UTF-8 text ({err.reason})") from None
    prompts: list[dict[str, Any]] = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputFileError(f"{source}: line {line_no}: not valid JSON: {err.msg}") from None
        if isinstance(record, dict) and isinstance(record.get("messages"), list) and record["messages"]:
            messages = record["messages"]
        elif isinstance(record, dict) and isinstance(record.get("prompt"), str) and record["prompt"].strip():
            messages = [{"role": "user", "content": record["prompt"]}]
        else:
            raise InputFileError(
                f"{source}: line {line_no}: expected {{'messages': [...]}} or {{'prompt': '...'}}"
            )
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append({"messages": messages, "token_ids": tokenizer(text, add_special_tokens=False)["input_ids"]})
        if len(prompts) == num_prompts:
            break
    if not prompts:
        raise InputFileError(f"{source}: no prompts ({param})")
    return prompts


def load_prompt_sets(params: EvaluateParams, prepared_dir: Path, tokenizer: Any) -> dict[str, list[list[int]]]:
    """Token ids of each evaluation set: ``val`` (held-out conversations, or evaluate.prompts) and, with
    evaluate.general_prompts, ``general``, which must share no prompt with the training rows."""
    val_source = Path(params.prompts) if params.prompts else prepared_dir / VAL_PROMPTS_FILE
    sets = {"val": load_prompts(val_source, params.num_prompts, tokenizer)}
    if params.general_prompts:
        general = load_prompts(Path(params.general_prompts), params.num_prompts, tokenizer, "evaluate.general_prompts")
        check_disjoint(general, prepared_dir, tokenizer, f"evaluate.general_prompts ({params.general_prompts})")
        sets["general"] = general
    return {name: [p["token_ids"] for p in prompts] for name, prompts in sets.items()}


def check_disjoint(prompts: list[dict[str, Any]], prepared_dir: Path, tokenizer: Any, what: str) -> None:
    """Refuses a set whose user messages appear in a training row: it would measure recall, not generalization.

    Raises:
        InputFileError: naming the set and the first prompt found in the training rows.
    """
    from datasets import load_from_disk

    from eaglenest.prepare import load_split

    train_rows = load_split(prepared_dir)["train_rows"]
    dataset = load_from_disk(str(prepared_dir)).with_format(None)
    texts = [tokenizer.decode(ids) for ids in dataset[:train_rows]["input_ids"]]
    for number, prompt in enumerate(prompts, start=1):
        for message in prompt["messages"]:
            content = message["content"].strip()
            if message["role"] == "user" and any(content in text for text in texts):
                raise InputFileError(
                    f"{what}: prompt {number} ({content[:60]!r}) is also in the training rows of {prepared_dir}: an "
                    "evaluation set must be disjoint from training; remove it from the set or from prepare.source"
                )


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


def evaluate_draft_hf(params: EvaluateParams, verifier_dir: Path, prompt_sets: dict[str, list[list[int]]],
                      draft_dir: Path) -> dict[str, dict[str, Any]]:
    """Speculative decoding against transformers' own ``generate`` on each prompt set; metrics per set."""
    from transformers import AutoModelForCausalLM

    info, model_dir = load_verifier_info(verifier_dir)
    tokenizer = load_tokenizer(verifier_dir)
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
    first = next(iter(prompt_sets.values()))[0]
    speculative_decode(verifier, drafter, first, k, min(8, params.max_new_tokens), eos)
    _hf_generate(verifier_model, first, params, eos, tokenizer, min(8, params.max_new_tokens))
    return {name: _evaluate_set_hf(prompts, params, verifier, verifier_model, drafter, tokenizer, eos, k, generator)
            for name, prompts in prompt_sets.items()}


def _evaluate_set_hf(prompts: list[list[int]], params: EvaluateParams, verifier: VerifierRunner, verifier_model: Any,
                     drafter: EagleDrafter, tokenizer: Any, eos: set[int], k: int, generator: torch.Generator
                     ) -> dict[str, Any]:
    """One prompt set: each prompt decoded alone by ``generate`` (the plain reference, tokens and time) and
    by speculative decoding; the n-gram baseline replayed on the plain output."""
    generate_s = spec_s = 0.0
    steps = accepted = 0
    per_position = [0] * k
    ngram = [0, 0, [0] * k]
    plains: list[list[int]] = []
    specs: list[list[int]] = []
    for prompt in prompts:
        plain, seconds = _hf_generate(verifier_model, prompt, params, eos, tokenizer)
        generate_s += seconds
        spec = speculative_decode(verifier, drafter, prompt, k, params.max_new_tokens, eos, params.temperature,
                                  generator)
        spec_s += spec.seconds
        steps += spec.verify_steps
        accepted += spec.accepted
        per_position = [a + b for a, b in zip(per_position, spec.accepted_per_position, strict=True)]
        plains.append(plain)
        specs.append(spec.tokens)
        n_steps, n_accepted, n_per_position = ngram_acceptance(prompt, plain, k)
        ngram[0] += n_steps
        ngram[1] += n_accepted
        ngram[2] = [a + b for a, b in zip(ngram[2], n_per_position, strict=True)]

    plain_rate = sum(map(len, plains)) / generate_s
    spec_rate = sum(map(len, specs)) / spec_s
    baseline = summarize(k, ngram[0], ngram[1], ngram[2])
    return {
        **summarize(k, steps, accepted, per_position),
        "tokens_per_s_plain": round(plain_rate, 2),
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


# The scalars repeated under flat per-set names (tau_general, vllm_speedup_val, ...), so that
# `dvc metrics diff` shows every set and back end side by side; the full figures stay under "sets".
FLAT_PER_SET = ("tau", "speedup", "speedup_batched", "lossless_fraction", "identical_fraction", "tau_ngram",
                "tokens_per_s_plain", "tokens_per_s_spec")


def flat_metrics(results: dict[str, dict[str, dict[str, Any]]], primary: str) -> dict[str, Any]:
    """``results[backend][set]`` as one flat mapping: the primary back end's ``val`` figures under their own
    names (as before there were sets), then ``{backend_}{metric}_{set}`` for every set, where the primary
    back end has no prefix; per-position acceptance as ``acceptance_pos_{i}[_{set}]``."""
    flat: dict[str, Any] = dict(results[primary]["val"])
    flat.update({f"acceptance_pos_{i + 1}": rate
                 for i, rate in enumerate(results[primary]["val"]["per_position_acceptance"])})
    for backend, sets in results.items():
        prefix = "" if backend == primary else f"{backend}_"
        for set_name, metrics in sets.items():
            for key in FLAT_PER_SET:
                if key in metrics:
                    flat[f"{prefix}{key}_{set_name}"] = metrics[key]
            for i, rate in enumerate(metrics["per_position_acceptance"]):
                flat[f"{prefix}acceptance_pos_{i + 1}_{set_name}"] = rate
    flat["sets"] = {set_name: {backend: results[backend][set_name] for backend in results}
                    for set_name in results[primary]}
    return flat


def write_eval_outputs(results: dict[str, dict[str, dict[str, Any]]], primary: str, metrics_path: Path,
                       plots_dir: Path) -> dict[str, Any]:
    """metrics/eval.json plus the two plot tables dvc.yaml declares (every set and back end); returns the
    flat metrics."""
    flat = flat_metrics(results, primary)
    atomic_write_json(metrics_path, flat)
    acceptance, tau = [], []
    for backend, sets in results.items():
        for set_name, metrics in sets.items():
            for drafter, rates in (("eagle3", metrics["per_position_acceptance"]),
                                   ("ngram", metrics.get("per_position_acceptance_ngram", []))):
                label = f"{drafter} {backend} {set_name}"
                acceptance += [{"position": i + 1, "drafter": label, "series": f"{label} {i + 1}", "acceptance": rate}
                               for i, rate in enumerate(rates)]
            tau += [{"drafter": f"eagle3 {backend} {set_name}", "tau": metrics["tau"]},
                    {"drafter": f"ngram {backend} {set_name}", "tau": metrics["tau_ngram"]}]
    k = results[primary]["val"]["num_speculative_tokens"]
    atomic_write_json(plots_dir / "acceptance.json", acceptance)
    atomic_write_json(plots_dir / "tau.json", [*tau, {"drafter": "upper bound (K+1)", "tau": k + 1}])
    return flat


def evaluate(params: EvaluateParams, verifier_dir: Path, prepared_dir: Path, draft_dir: Path, metrics_path: Path,
             plots_dir: Path) -> dict[str, Any]:
    """The evaluate stage: every back end of evaluate.backend on every prompt set."""
    tokenizer = load_tokenizer(verifier_dir)
    prompt_sets = load_prompt_sets(params, prepared_dir, tokenizer)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for backend in params.backends:
        if backend == "vllm":
            from eaglenest.evaluate_vllm import evaluate_draft_vllm

            results[backend] = evaluate_draft_vllm(params, verifier_dir, prompt_sets, draft_dir)
        else:
            results[backend] = evaluate_draft_hf(params, verifier_dir, prompt_sets, draft_dir)
        for set_name, metrics in results[backend].items():
            log.info("%s, %s prompts: tau %.3f (n-gram %.3f), speed-up %.3f, lossless %.2f", backend, set_name,
                     metrics["tau"], metrics["tau_ngram"], metrics["speedup"], metrics["lossless_fraction"])
    primary = params.backends[0]
    metrics = write_eval_outputs(results, primary, metrics_path, plots_dir)
    for backend, sets in results.items():
        for set_name, figures in sets.items():
            _require_lossless(params, figures, backend, set_name, metrics_path)
    return metrics


def _require_lossless(params: EvaluateParams, metrics: dict[str, Any], backend: str, set_name: str,
                      metrics_path: Path) -> None:
    """At temperature 0 every prompt must be lossless; otherwise the verification is wrong, whatever the draft.

    Raises:
        EaglenestError: naming the back end, the set and the rule.
    """
    if params.temperature > 0 or metrics["lossless_fraction"] >= 1.0:
        return
    rule = ("identical tokens" if metrics.get("lossless_rule", "exact") == "exact" else
            f"identical, or a near-tie flipped within evaluate.bf16_tie_margin={params.bf16_tie_margin}")
    raise EaglenestError(
        f"lossless_fraction = {metrics['lossless_fraction']} < 1.0 at temperature 0 (evaluate.backend: {backend}, "
        f"{set_name} prompts, rule: {rule}): greedy speculative decoding left plain greedy decoding on some of "
        f"{metrics['num_prompts']} prompts: the verification (acceptance rule) is wrong, whatever the draft; see "
        f"divergence_gaps under sets.{set_name}.{backend} in {metrics_path}"
    )
