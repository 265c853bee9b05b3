"""The ``vllm`` evaluate back end: vLLM 0.33's own EAGLE-3 on GPU, read through its spec-decode counters.

``LLM(model=verifier, speculative_config={"method": "eagle3", "model": draft, "num_speculative_tokens": K},
disable_log_stats=False)`` decodes the prompts; ``llm.get_metrics()`` holds the counters
``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens`` (Counters) and
``..._num_accepted_tokens_per_pos`` (a Vector, one value per position). They are process-wide and
cumulative, so a snapshot before the run is subtracted. A second ``LLM`` without speculation gives the
plain speed. Only this module imports vllm.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any

from eaglenest.errors import EaglenestError
from eaglenest.params import EvaluateParams

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def read_counters(metrics: list[Any]) -> dict[str, Any]:
    """Sums the spec-decode counters over engines/labels: {drafts, draft_tokens, accepted, per_position}."""
    counters: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_position": []}
    for metric in metrics:
        if metric.name == DRAFTS:
            counters["drafts"] += int(metric.value)
        elif metric.name == DRAFT_TOKENS:
            counters["draft_tokens"] += int(metric.value)
        elif metric.name == ACCEPTED:
            counters["accepted"] += int(metric.value)
        elif metric.name == ACCEPTED_PER_POS:
            values = [int(v) for v in metric.values]
            previous = counters["per_position"]
            counters["per_position"] = [a + b for a, b in zip(previous + [0] * (len(values) - len(previous)),
                                                             values + [0] * (len(previous) - len(values)),
                                                             strict=True)]
    return counters


def counters_to_metrics(before: dict[str, Any], after: dict[str, Any], k: int) -> dict[str, Any]:
    """tau, per-position acceptance and draft acceptance rate from two counter snapshots (vLLM's formulas)."""
    drafts = after["drafts"] - before["drafts"]
    accepted = after["accepted"] - before["accepted"]
    draft_tokens = after["draft_tokens"] - before["draft_tokens"]
    per_pos_after = after["per_position"] + [0] * (k - len(after["per_position"]))
    per_pos_before = before["per_position"] + [0] * (k - len(before["per_position"]))
    per_position = [a - b for a, b in zip(per_pos_after[:k], per_pos_before[:k], strict=True)]
    return {
        "tau": round(1 + accepted / drafts, 4) if drafts else 1.0,  # vLLM's mean acceptance length
        "per_position_acceptance": [round(c / drafts, 4) if drafts else 0.0 for c in per_position],
        "draft_acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else 0.0,
        "verify_steps": drafts,
    }


def evaluate_draft_vllm(params: EvaluateParams, verifier_dir: Path, prepared_dir: Path, draft_dir: Path
                        ) -> dict[str, Any]:
    """Speculative vs plain decoding in vLLM; the same metric names as the hf back end."""
    if importlib.util.find_spec("vllm") is None:
        raise EaglenestError("evaluate.backend: vllm needs vLLM on a GPU machine: `pip install -e '.[vllm]'`")
    from vllm import LLM, SamplingParams

    from eaglenest.evaluate import load_prompts
    from eaglenest.speculative import ngram_acceptance
    from eaglenest.verifier import load_tokenizer, load_verifier_info

    info, model_dir = load_verifier_info(verifier_dir)
    tokenizer = load_tokenizer(verifier_dir)
    prompts = load_prompts(params, prepared_dir, tokenizer)
    k = params.num_speculative_tokens or json.loads((draft_dir / "config.json").read_text())[
        "speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    sampling = SamplingParams(max_tokens=params.max_new_tokens, temperature=params.temperature, seed=params.seed)
    requests = [{"prompt_token_ids": p} for p in prompts]
    common = {"model": str(model_dir), "trust_remote_code": info.trust_remote_code,
              "gpu_memory_utilization": params.gpu_memory_utilization / 2, "disable_log_stats": False,
              "max_model_len": max(len(p) for p in prompts) + params.max_new_tokens + k + 1}

    plain_llm = LLM(**common)
    plain_llm.generate(requests[:1], sampling, use_tqdm=False)  # warm-up
    started = time.perf_counter()
    plain = plain_llm.generate(requests, sampling, use_tqdm=False)
    plain_s = time.perf_counter() - started
    plain_tokens = [list(o.outputs[0].token_ids) for o in plain]
    del plain_llm

    spec_llm = LLM(**common, speculative_config={"method": "eagle3", "model": str(draft_dir),
                                                 "num_speculative_tokens": k})
    spec_llm.generate(requests[:1], sampling, use_tqdm=False)  # warm-up
    before = read_counters(spec_llm.get_metrics())
    started = time.perf_counter()
    spec = spec_llm.generate(requests, sampling, use_tqdm=False)
    spec_s = time.perf_counter() - started
    after = read_counters(spec_llm.get_metrics())
    spec_tokens = [list(o.outputs[0].token_ids) for o in spec]

    ngram = [ngram_acceptance(p, out, k) for p, out in zip(prompts, plain_tokens, strict=True)]
    ngram_steps = sum(n[0] for n in ngram)
    plain_rate = sum(map(len, plain_tokens)) / plain_s
    spec_rate = sum(map(len, spec_tokens)) / spec_s
    return {
        **counters_to_metrics(before, after, k),
        "tokens_per_s_plain": round(plain_rate, 2),
        "tokens_per_s_spec": round(spec_rate, 2),
        "speedup": round(spec_rate / plain_rate, 4),
        "lossless_fraction": round(sum(a == b for a, b in zip(spec_tokens, plain_tokens, strict=True))
                                   / len(prompts), 4),
        "tau_ngram": round(1 + sum(n[1] for n in ngram) / ngram_steps, 4) if ngram_steps else 1.0,
        "per_position_acceptance_ngram": [round(sum(n[2][i] for n in ngram) / ngram_steps, 4) if ngram_steps
                                          else 0.0 for i in range(k)],
        "num_speculative_tokens": k,
        "num_prompts": len(prompts),
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "backend": "vllm",
    }
