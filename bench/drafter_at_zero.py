"""Benchmark (run by hand): what K = 0 costs under load, for vLLM's own EAGLE-3 proposer and for eaglenest's drafter
(:mod:`eaglenest.core.drafter`) with each way it has of making K = 0 free: ``catch_up`` (skip the draft's forward,
feed the skipped positions when the request drafts again: exact) and ``retire`` (never draft the request again).

    .venv/bin/python bench/drafter_at_zero.py [--in-flight 4 16] [--requests 32] [--max-new-tokens 64] \\
        [--rounds 5] [--out bench/results/drafter_at_zero.json]

Each load runs in a process of its own (this script again, with ``--one-load``): vLLM's CPU build cannot start an
engine in a process whose earlier in-process engines were stopped (its parallel state is torn down with them).

Run in a checkout whose pipeline is up to date (``models/verifier``, ``models/draft``). Every engine is the same
engine but for its drafting: the verifier in evaluate's dtype, no prefix cache, ``max_num_seqs`` = the requests in
flight, and the drafting engines at the draft's own K with the schedule ``[[1, 1, K], [2, N, 0]]`` (K alone, none
from two requests in flight on), so that at every load past one stream the schedule says K = 0 at nearly every step.
Each round, every engine in turn decodes the same ``--requests`` prompts of the general set (chat-templated,
``ignore_eos``: every request emits ``--max-new-tokens``), all given at once: a closed batch at the load. The figure
is each engine's tokens/s over the plain engine's in the same round, its mean over rounds with a 95% t-interval.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eaglenest.artifacts.draft import draft_tokens
from eaglenest.artifacts.verifier import load_tokenizer, load_verifier_info
from eaglenest.commands.params_file import load_params
from eaglenest.core.atomic import atomic_write_json
from eaglenest.core.drafter.config import CONFIG_KEY, DrafterConfig, speculative_config
from eaglenest.core.host import host_record, short_commit
from eaglenest.core.vllm_support import create_llm, generate

# the 95% two-sided t quantiles for 1..10 degrees of freedom
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228]


def engines(model_dir: Path, draft: Path, k: int, in_flight: int, dtype: str) -> dict[str, dict]:
    """Each engine's ``vllm.LLM`` kwargs: plain, vLLM's eagle3, the drafter catching up, the drafter retiring."""
    schedule = [[1, 1, k], [2, max(in_flight, 2), 0]]
    common = {
        "model": str(model_dir),
        "dtype": dtype,
        "max_model_len": 1024,
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "seed": 0,
        "max_num_seqs": in_flight,
    }
    vllm_own = {
        "method": "eagle3",
        "model": str(draft),
        "num_speculative_tokens": k,
        "num_speculative_tokens_per_batch_size": schedule,
    }
    kwargs = {"plain": common, "eagle3": {**common, "speculative_config": vllm_own}}
    for at_zero in ("catch_up", "retire"):
        config = DrafterConfig(draft_k=k, at_zero=at_zero)
        kwargs[at_zero] = {
            **common,
            "speculative_config": speculative_config(str(draft), config, schedule),
            "additional_config": {CONFIG_KEY: config.model_dump()},
        }
    return kwargs


def interval(ratios: list[float]) -> dict[str, float]:
    """Mean and 95% t half-width over rounds."""
    mean = statistics.fmean(ratios)
    half = T95[len(ratios) - 2] * statistics.stdev(ratios) / math.sqrt(len(ratios)) if len(ratios) > 1 else 0.0
    return {"value": round(mean, 4), "ci95": round(half, 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--in-flight", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/results/drafter_at_zero.json"))
    parser.add_argument("--one-load", type=Path, default=None, help=argparse.SUPPRESS)  # a child's output file
    args = parser.parse_args()
    if args.one_load is None and len(args.in_flight) > 1:
        return each_load_alone(args)
    # four engines up at once on the CPU build: a GiB of KV cache each holds every request in flight
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from eaglenest.artifacts.eval_sets import load_eval_sets

    params = load_params("params.yaml").evaluate
    verifier, draft = Path("models/verifier"), Path("models/draft")
    tokenizer = load_tokenizer(verifier)
    info, model_dir = load_verifier_info(verifier)
    k = draft_tokens(draft, "the draft")
    (general,) = [s for s in load_eval_sets(params.sets, Path("data/prepared"), tokenizer) if s.name == "general"]
    prompts = [general.render(c, 0, [], tokenizer) for c in general.conversations[: args.requests]]
    dtype = "bfloat16" if host_record("auto").get("bf16_native") else "float32"
    record = {
        "command": " ".join(["bench/drafter_at_zero.py", *sys.argv[1:]]),
        "commit": short_commit(),
        "host": host_record(dtype),
        "k": k,
        "requests": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds,
        "loads": {},
    }
    from vllm import SamplingParams

    sampling = SamplingParams(max_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    for in_flight in args.in_flight:
        llms = {
            name: create_llm(kwargs, "bench", what=name, in_process_on_cpu=True)
            for name, kwargs in engines(model_dir, draft, k, in_flight, dtype).items()
        }
        for llm in llms.values():  # a warm-up batch each: kernels for the batch shapes
            generate(llm, requests[:in_flight], sampling, "bench")
        rates: dict[str, list[float]] = {name: [] for name in llms}
        for _ in range(args.rounds):
            for name, llm in llms.items():
                started = time.perf_counter()
                outputs = generate(llm, requests, sampling, "bench")
                seconds = time.perf_counter() - started
                rates[name].append(sum(len(o.outputs[0].token_ids) for o in outputs) / seconds)
        record["loads"][str(in_flight)] = {
            name: {
                "tokens_per_s": [round(r, 2) for r in rates[name]],
                "over_plain": interval([r / p for r, p in zip(rates[name], rates["plain"], strict=True)]),
            }
            for name in llms
        }
        for name in llms:
            figure = record["loads"][str(in_flight)][name]["over_plain"]
            print(f"{in_flight} in flight, {name}: x{figure['value']:.3f} ± {figure['ci95']:.3f} over plain")
    out = args.one_load or args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, record)
    return 0


def each_load_alone(args: argparse.Namespace) -> int:
    """Runs each load in a child process and writes one record of them all."""
    merged: dict = {}
    with tempfile.TemporaryDirectory() as scratch:
        for in_flight in args.in_flight:
            part = Path(scratch) / f"{in_flight}.json"
            common = ["--requests", str(args.requests), "--max-new-tokens", str(args.max_new_tokens)]
            child = [sys.executable, __file__, "--in-flight", str(in_flight), *common, "--rounds", str(args.rounds)]
            if subprocess.run([*child, "--one-load", str(part)]).returncode != 0:
                return 1
            record = json.loads(part.read_text())
            merged = {**record, "loads": {**merged.get("loads", {}), **record["loads"]}}
    merged["command"] = " ".join(["bench/drafter_at_zero.py", *sys.argv[1:]])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, merged)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
