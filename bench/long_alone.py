"""Benchmark (run by hand): does a prompt decoded alone accept as many drafts as in a batch? Per prompt of one
evaluation set, the draft's verify steps and accepted tokens in vLLM, decoded in one batch as evaluate's batched pass
decodes them, and decoded again in groups of each ``--group`` size (1: alone, as evaluate's timed turns).

    .venv/bin/python bench/long_alone.py [--set long] [--prompts 8] [--group 1 2 8] [--attn-isa vec] \\
        [--env VLLM_CPU_ATTN_SPLIT_KV=0] [--out bench/results/long_alone.json]
    bench/avx512_host.sh .venv/bin/python bench/long_alone.py ...   # as a CPU with AVX512-BF16 and no AMX

Run in a checkout whose pipeline is up to date (``models/verifier``, ``models/draft``, ``data/prepared``). One
engine, evaluate's (:func:`eaglenest.stages.evaluate.vllm.engine_kwargs`: sized for the set's batched pass, the
draft at its own K), started once per run; ``--env`` values are set before it starts, ``--attn-isa`` makes vLLM's
CPU attention use that kernel family (``amx``, ``vec``, ``vec16``) instead of the one it picks for this CPU.
Greedy decoding emits the verifier's tokens either way; what may differ is how many of the draft's it accepts.
Writes one JSON record (the host kind, the options, per prompt and group size the counts) and prints a table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", default="long", help="the evaluate.sets entry (default: long)")
    parser.add_argument(
        "--prompts", type=int, default=8, help="prompts decoded in groups (default: 8, evaluate's timed turns)"
    )
    parser.add_argument("--group", type=int, nargs="+", default=[1], help="group sizes to decode them in")
    parser.add_argument("--attn-isa", default=None, help="vLLM CPU attention kernels to use (amx, vec, vec16)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="set before the engine")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    for pair in args.env:
        key, _, value = pair.partition("=")
        os.environ[key] = value

    from eaglenest.artifacts.draft import draft_tokens, vllm_speculative_config
    from eaglenest.artifacts.eval_sets import load_eval_sets
    from eaglenest.artifacts.verifier import load_tokenizer, load_verifier_info
    from eaglenest.commands.params_file import load_params
    from eaglenest.core.atomic import atomic_write_json
    from eaglenest.core.host import host_record
    from eaglenest.core.measure.engines import EngineBase, NgramSetting, sampling_params, start_engine, stop_engine
    from eaglenest.core.measure.spec_counters import request_counts
    from eaglenest.core.vllm_support import generate
    from eaglenest.stages.evaluate.job import EvaluationJob
    from eaglenest.stages.evaluate.vllm import conversation_requests, engine_kwargs

    if args.attn_isa:
        import vllm.v1.attention.backends.cpu_attn as cpu_attn

        cpu_attn._get_attn_isa = lambda *a, **kw: args.attn_isa

    params = load_params("params.yaml").evaluate
    verifier, draft, prepared = Path("models/verifier"), Path("models/draft"), Path("data/prepared")
    tokenizer = load_tokenizer(verifier)
    (eval_set,) = [s for s in load_eval_sets(params.sets, prepared, tokenizer) if s.name == args.set]
    info, model_dir = load_verifier_info(verifier)
    k = draft_tokens(draft, "the draft")
    job = EvaluationJob(params, verifier, [eval_set], draft)
    base = EngineBase(model_dir, info, params.vllm, params.seed, at_once=3)
    kwargs = engine_kwargs(
        base, conversation_requests(job, tokenizer, k), vllm_speculative_config(draft, k), NgramSetting.vllm_default(k)
    )["spec"]
    prompts = [eval_set.render(c, 0, [], tokenizer) for c in eval_set.conversations]
    sampling = sampling_params(eval_set.params.max_new_tokens, 0.0, params.seed)
    llm, _ = start_engine(kwargs, "bench", "the draft", prompts[-1], params.seed, prompts[: args.prompts])

    def decode(group: list[list[int]]) -> list[dict]:
        outputs = generate(llm, [{"prompt_token_ids": p} for p in group], sampling, "bench")
        counted = [request_counts(o, k) for o in outputs]
        return [
            {"steps": c.drafts, "accepted": c.accepted, "tokens": len(o.outputs[0].token_ids)}
            for c, o in zip(counted, outputs, strict=True)
        ]

    try:
        runs = {"batched": decode(prompts)[: args.prompts]}  # every prompt of the set at once, as evaluate
        for size in args.group:
            counts = []
            for start in range(0, args.prompts, size):
                counts += decode(prompts[start : start + size])
            runs[f"groups of {size}"] = counts
    finally:
        stop_engine(llm)

    def tau(counts: list[dict]) -> float:
        return round(1 + sum(c["accepted"] for c in counts) / max(1, sum(c["steps"] for c in counts)), 4)

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    record = {
        "command": " ".join(["bench/long_alone.py", *sys.argv[1:]]),
        "commit": commit,
        "host": host_record(kwargs["dtype"]),
        "set": args.set,
        "k": k,
        "attn_isa": args.attn_isa,
        "env": args.env,
        "prompt_tokens": [len(p) for p in prompts[: args.prompts]],
        "tau": {name: tau(counts) for name, counts in runs.items()},
        "runs": runs,
    }
    print(
        f"{args.set}, K = {k}, attention {args.attn_isa or 'as vLLM picks'}, env {args.env or '-'}, "
        f"{record['host']['key']}"
    )
    print("prompt tokens  " + "  ".join(f"{name:>14s}" for name in runs))
    for i, tokens in enumerate(record["prompt_tokens"]):
        print(f"{tokens:13d}  " + "  ".join(f"{runs[n][i]['steps']:>6d} / {runs[n][i]['accepted']:<5d}" for n in runs))
    print("tau            " + "  ".join(f"{record['tau'][n]:>14.4f}" for n in runs))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.out, record)


if __name__ == "__main__":
    sys.exit(main())
