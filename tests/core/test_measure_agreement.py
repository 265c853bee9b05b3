"""The three places that measure speculative decoding with vLLM agree: evaluate's timing path, the k_sweep stage's
and ``eaglenest bench``'s speed-up and counters, on one tiny random verifier and one tiny random EAGLE-3 draft, the
same prompts and K, one pair of engines (the measurement kit's, :mod:`eaglenest.core.measure`).

Fed the same timed turns, the three compute the same speed-up and interval to the last digit; each timing the
turns itself, their speed-ups lie within each other's intervals, and their tau (per-request counts for evaluate
and the k_sweep stage, the process's prometheus registry, what a server's ``/metrics`` renders, for bench) is one
figure: the same greedy decodings, counted three ways.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eaglenest.artifacts.draft import save_draft, vllm_speculative_config
from eaglenest.artifacts.eval_params import EvaluateParams
from eaglenest.artifacts.evaluation import speedup_interval as evaluate_speedup
from eaglenest.artifacts.verifier import INFO_FILE, load_verifier_info
from eaglenest.commands.bench.counters import acceptance
from eaglenest.commands.bench.figures import single_stream_speedup
from eaglenest.core.measure.beside_plain import TimedTurns, add_speedup, time_beside_plain, timed_entry
from eaglenest.core.measure.engines import (
    EngineBase,
    drafting,
    request_tokens,
    sampling_params,
    start_engine,
    stop_engine,
)
from eaglenest.core.measure.single_stream import output_tokens, time_interleaved, tokens_and_seconds
from eaglenest.core.measure.spec_counters import parse_metrics
from eaglenest.core.params import VllmEngineParams
from eaglenest.stages.evaluate.vllm import add_timed
from tests.conftest import requires_vllm
from tests.fixtures.models import build_tiny_verifier

K = 2
MAX_NEW = 64
SAMPLES = EvaluateParams().bootstrap_samples  # bench resamples as many (evaluate.bootstrap_samples' default)
PARAM = "agreement"


def tiny_verifier_and_draft(root: Path) -> tuple[Path, Path]:
    """A random tiny Llama verifier vLLM's CPU build runs (heads of 32) with its verifier stage record, and a random
    one-layer EAGLE-3 draft for it at K = 2 (full vocabulary)."""
    from eaglenest.stages.train.model import build_draft
    from eaglenest.stages.train.params import TrainParams

    model_dir = build_tiny_verifier(root / "model", num_layers=4, hidden_size=64, num_heads=2)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    verifier_dir = root / "verifier"
    verifier_dir.mkdir()
    (verifier_dir / INFO_FILE).write_text(
        json.dumps(
            {
                "source": str(model_dir),
                "kind": "local",
                "path": str(model_dir),
                "name": "tiny/llama",
                "fingerprint": "0" * 64,
                "model_type": "llama",
                "num_layers": 4,
                "hidden_size": 64,
                "vocab_size": vocab,
                "max_position_embeddings": 512,
                "aux_layers": [1, 2, 3],
                "layer_ids": [1, 2, 3, 4],
                "trust_remote_code": False,
            }
        )
    )
    info, _ = load_verifier_info(verifier_dir)
    draft = build_draft(
        info,
        model_dir,
        TrainParams(ttt_steps=K),
        vocab,
        torch.zeros(vocab, dtype=torch.long),
        torch.ones(vocab, dtype=torch.bool),
        "sdpa",
    )
    save_draft(draft, root / "draft", "tiny/llama")
    return verifier_dir, root / "draft"


def registry_reading(where: str):
    """The process's prometheus registry as a server's /metrics renders it, read as bench reads a server."""
    from prometheus_client import REGISTRY, generate_latest

    return parse_metrics(generate_latest(REGISTRY).decode(), where)


def bench_raw(timed: list) -> dict:
    """What ``vllm bench serve --save-detailed`` records of one endpoint's requests at concurrency 1."""
    return {
        "output_lens": [len(output_tokens(o)) for o, _ in timed],
        "latencies": [s for _, s in timed],
        "errors": [""] * len(timed),
    }


def evaluate_records(timed: dict[str, list], k: int) -> list[dict]:
    """evaluate's records of the timed turns (one conversation each), as its vllm back end writes them."""
    records = []
    for i in range(len(timed["plain"])):
        record = {"id": str(i)}
        add_timed(record, {drafter: turns[i] for drafter, turns in timed.items()}, k, {"ngram": k})
        records.append(record)
    return records


def overlap(a, b) -> bool:
    return a.low <= b.high and b.low <= a.high


# The three paths time their turns one after another, so whatever else the machine does between them moves one
# path's speed-up and not another's (on a tiny model a turn is milliseconds); agreement is required in one of this
# many rounds, each timing all three afresh. Paths that disagree in what they measure disagree in every round.
ROUNDS = 3


def measure_three_ways(plain, spec, prompts, warm_up, requests, params) -> SimpleNamespace:
    """One round: evaluate's, the k_sweep stage's and bench's paths, each timing the prompts itself, with the
    arithmetic of all three checked on evaluate's own timed turns."""
    sampling = sampling_params(MAX_NEW, 0.0, params.seed)  # the stages' greedy sampling

    # evaluate's path: the engines take turns, each turn's figures go into its record, the records give the figure
    timed = time_interleaved({"plain": plain, "spec": spec}, prompts, sampling, PARAM, "evaluate's path")
    records = evaluate_records(timed, K)
    by_evaluate = evaluate_speedup(records, SAMPLES, params.seed)
    tau_evaluate = 1 + sum(r["alone_accepted"] for r in records) / sum(r["alone_steps"] for r in records)

    # the same timed turns through the k_sweep stage's and bench's arithmetic: one figure, one interval
    entry = timed_entry(timed["spec"], tokens_and_seconds(timed["plain"]))
    add_speedup(entry, SAMPLES, params.seed)
    by_bench = single_stream_speedup(bench_raw(timed["spec"]), bench_raw(timed["plain"]))
    assert (entry["speedup"], entry["speedup_ci95"]) == (round(by_evaluate.value, 3), round(by_evaluate.half_width, 3))
    # bench reads vLLM's unrounded seconds, the records hold microseconds
    assert by_bench is not None and by_bench.value == pytest.approx(by_evaluate.value, abs=1e-4)
    assert by_bench.half_width == pytest.approx(by_evaluate.half_width, abs=1e-3)
    assert entry["tau_when_drafted"] == round(tau_evaluate, 3)

    # the k_sweep stage's path, timing for itself
    eval_set = SimpleNamespace(name="prompts", params=SimpleNamespace(max_new_tokens=MAX_NEW, temperature=0.0))
    turns = TimedTurns([eval_set], {"prompts": prompts}, warm_up, requests)
    swept = time_beside_plain(turns, plain, {"draft": spec}, params, PARAM, "the k_sweep stage's path")["draft"][
        "prompts"
    ]

    # bench's path: a server's counters around its run, its requests' tokens and seconds
    before = registry_reading("before")
    served = time_interleaved({"plain": plain, "spec": spec}, prompts, sampling, PARAM, "bench's path")
    counted = acceptance(before, registry_reading("after"))
    benched = single_stream_speedup(bench_raw(served["spec"]), bench_raw(served["plain"]))

    assert [output_tokens(o) for o, _ in timed["spec"]] == [output_tokens(o) for o, _ in served["spec"]]
    # one tau: the same greedy decodings, counted per request (evaluate, k_sweep) and by the registry (bench)
    assert counted is not None and counted.drafts > 0
    assert swept["tau_when_drafted"] == round(tau_evaluate, 3) == round(counted.tau, 3)
    assert benched is not None
    by_sweep = SimpleNamespace(
        low=swept["speedup"] - swept["speedup_ci95"], high=swept["speedup"] + swept["speedup_ci95"]
    )
    print(
        f"speed-ups: evaluate {by_evaluate.as_dict()}, k_sweep x{swept['speedup']} ± {swept['speedup_ci95']}, "
        f"bench {benched.as_dict()}; tau {tau_evaluate:.4f}"
    )
    return SimpleNamespace(evaluate=by_evaluate, sweep=by_sweep, bench=benched)


@pytest.mark.slow
@pytest.mark.exclusive  # each path's self-timed speed-up must not meet another test's load
@requires_vllm
def test_evaluate_k_sweep_and_bench_report_one_speed_up_and_one_tau(tmp_path: Path):
    verifier_dir, draft_dir = tiny_verifier_and_draft(tmp_path)
    info, model_dir = load_verifier_info(verifier_dir)
    params = EvaluateParams(bootstrap_samples=SAMPLES, vllm=VllmEngineParams(dtype="float32"))
    prompts = [[10 + (7 * i + j) % 200 for j in range(6 + 4 * i)] for i in range(12)]  # 6 to 50 tokens
    warm_up = [5, 6, 7, 8]
    requests = [request_tokens(len(p), MAX_NEW, K) for p in [warm_up, *prompts]]
    base = EngineBase(model_dir, info, params.vllm, params.seed, at_once=2)
    common = base.kwargs(requests)
    plain, _ = start_engine(common, PARAM, "the verifier", warm_up, params.seed, prompts)
    spec = None
    agreed = False
    try:
        # the draft's engine starts last: its counters are the ones in the process's registry
        spec, _ = start_engine(
            drafting(common, vllm_speculative_config(draft_dir, K)),
            PARAM,
            "the tiny draft",
            warm_up,
            params.seed,
            prompts,
        )
        for _ in range(ROUNDS):
            three = measure_three_ways(plain, spec, prompts, warm_up, requests, params)
            # one speed-up: each path's figure within the others' intervals
            agreed = (
                overlap(three.evaluate, three.sweep)
                and overlap(three.evaluate, three.bench)
                and overlap(three.sweep, three.bench)
            )
            if agreed:
                break
    finally:
        for llm in (spec, plain):
            if llm is not None:
                stop_engine(llm)
    assert agreed, f"the three paths' speed-up intervals did not all overlap in any of {ROUNDS} rounds"
