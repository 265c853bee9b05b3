"""Benchmark (run by hand): evaluate's plain, draft and n-gram engines run eagerly and compiled, each decoding the
first turns of each headline set one at a time: how long each engine takes to start and how fast it decodes.

    .venv/bin/python bench/engine_execution.py [--executions eager compiled] [--engines plain spec ngram] \\
        [--prompts 4] [--out bench/results/engine_execution.json]

Run in a checkout whose pipeline is up to date (``models/verifier``, ``models/draft``, ``data/prepared``,
``metrics/free_sweep.json``). The engines are evaluate's (:func:`eaglenest.stages.evaluate.vllm.engine_kwargs`),
with ``evaluate.vllm.execution`` replaced by each of ``--executions`` in turn, one engine at a time in this process.
Each decodes every turn twice and the second pass is timed. Start seconds are the first engine's of its graph unless
vLLM's compile cache (``VLLM_CACHE_ROOT``) already holds it: point that at an empty folder to time a first compile.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--executions", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument("--engines", nargs="+", default=["plain", "spec", "ngram"], choices=["plain", "spec", "ngram"])
    parser.add_argument("--prompts", type=int, default=4, help="turns per headline set (default: 4)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from eaglenest.artifacts.draft import draft_tokens, vllm_speculative_config
    from eaglenest.artifacts.eval_sets import load_eval_sets
    from eaglenest.artifacts.free_record import measured_ngram
    from eaglenest.artifacts.verifier import load_tokenizer, load_verifier_info
    from eaglenest.commands.params_file import load_params
    from eaglenest.core.atomic import atomic_write_json
    from eaglenest.core.host import host_record, short_commit
    from eaglenest.core.measure.engines import EngineBase, sampling_params, start_engine, stop_engine
    from eaglenest.core.measure.single_stream import decode_alone
    from eaglenest.core.vllm_support import compile_env, installed_build
    from eaglenest.stages.evaluate.job import EvaluationJob
    from eaglenest.stages.evaluate.vllm import conversation_requests, engine_kwargs

    # vLLM reads its environment once, when the first engine of a process starts: a compiled engine's settings
    # must be in place before it, even where an eager engine comes first.
    build = installed_build()
    os.environ.update(compile_env(build is not None and build.kind == "cpu"))
    params = load_params("params.yaml").evaluate
    verifier, draft = Path("models/verifier"), Path("models/draft")
    tokenizer = load_tokenizer(verifier)
    sets = [s for s in load_eval_sets(params.sets, Path("data/prepared"), tokenizer) if s.params.headline]
    info, model_dir = load_verifier_info(verifier)
    k = draft_tokens(draft, "the draft")
    ngram = measured_ngram(info.fingerprint, k, Path("metrics/free_sweep.json")).setting
    job = EvaluationJob(params, verifier, sets, draft)
    turns = [(s, s.render(c, 0, [], tokenizer)) for s in sets for c in s.conversations[: args.prompts]]
    warm_up = sets[0].render(sets[0].conversations[-1], 0, [], tokenizer)
    record: dict = {
        "command": " ".join(["bench/engine_execution.py", *sys.argv[1:]]),
        "commit": short_commit(),
        "k": k,
        "ngram": ngram.label,
        "turns_per_set": args.prompts,
        "engines": {},
    }
    for execution in args.executions:
        engine = params.vllm.model_copy(update={"execution": execution})
        base = EngineBase(model_dir, info, engine, params.seed, at_once=3)
        kwargs = engine_kwargs(
            base, conversation_requests(job, tokenizer, max(k, ngram.k)), vllm_speculative_config(draft, k), ngram
        )
        record.setdefault("host", host_record(kwargs["plain"]["dtype"]))
        for drafter in args.engines:
            started = time.perf_counter()
            llm, _ = start_engine(kwargs[drafter], "bench", drafter, warm_up, params.seed, [p for _, p in turns])
            start_s = time.perf_counter() - started
            per_set: dict[str, list[float]] = {}
            try:
                for timed in (False, True):
                    for eval_set, prompt in turns:
                        sampling = sampling_params(eval_set.params.max_new_tokens, 0.0, params.seed)
                        ((output, spent),) = decode_alone(llm, [prompt], sampling, "bench")
                        if timed:
                            seconds_tokens = per_set.setdefault(eval_set.name, [0.0, 0])
                            seconds_tokens[0] += spent
                            seconds_tokens[1] += len(output.outputs[0].token_ids)
            finally:
                stop_engine(llm)
            entry = {
                "start_s": round(start_s, 1),
                "sets": {
                    name: {"seconds": round(s, 3), "tokens": n, "tokens_per_s": round(n / s, 2)}
                    for name, (s, n) in per_set.items()
                },
            }
            record["engines"][f"{execution}/{drafter}"] = entry
            rates = ", ".join(f"{name} {v['tokens_per_s']:.1f}" for name, v in entry["sets"].items())
            print(f"{execution:8s} {drafter:5s} start {start_s:5.1f} s; tokens/s {rates}", flush=True)
    print(record["host"]["key"])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.out, record)


if __name__ == "__main__":
    sys.exit(main())
