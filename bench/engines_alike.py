"""Benchmark (run by hand): what starting the engines alike changed. evaluate's plain and n-gram engines as they were
started before (the plain one without stats logging; the n-gram one sized for one request: ``max_num_seqs`` 1 and a
one-request KV cache) beside the same engines started alike (one set of kwargs, :func:`eaglenest.stages.evaluate.
vllm.engine_kwargs`), all four taking turns prompt by prompt on evaluate's timed turns.

    .venv/bin/python bench/engines_alike.py [--prompts 8] [--out bench/results/engines_alike.json]

Run in a checkout whose pipeline is up to date (``models/verifier``, ``models/draft``, ``data/prepared``,
``metrics/free_sweep.json``). The figures are each new engine's tokens/s over its old twin's, paired turn by turn,
with a 95% interval (the measurement kit's speed-up statistic), per headline set and pooled; and each n-gram engine's
speed-up over the plain engine of its own kind, the figure evaluate reports.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="timed turns per headline set (default: evaluate's 8)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from eaglenest.artifacts.draft import draft_tokens, vllm_speculative_config
    from eaglenest.artifacts.eval_sets import load_eval_sets
    from eaglenest.artifacts.free_record import measured_ngram
    from eaglenest.artifacts.verifier import load_tokenizer, load_verifier_info
    from eaglenest.commands.params_file import load_params
    from eaglenest.core.atomic import atomic_write_json
    from eaglenest.core.host import host_record, short_commit
    from eaglenest.core.measure.beside_plain import pooled_speedup
    from eaglenest.core.measure.engines import (
        DRAFTING_KEYS,
        EngineBase,
        request_tokens,
        sampling_params,
        start_engine,
        stop_engine,
    )
    from eaglenest.core.measure.single_stream import time_interleaved, tokens_and_seconds
    from eaglenest.stages.evaluate.job import EvaluationJob
    from eaglenest.stages.evaluate.vllm import conversation_requests, engine_kwargs

    params = load_params("params.yaml").evaluate
    verifier, draft = Path("models/verifier"), Path("models/draft")
    tokenizer = load_tokenizer(verifier)
    sets = [s for s in load_eval_sets(params.sets, Path("data/prepared"), tokenizer) if s.params.headline]
    info, model_dir = load_verifier_info(verifier)
    k = draft_tokens(draft, "the draft")
    ngram = measured_ngram(info.fingerprint, k, Path("metrics/free_sweep.json")).setting
    base = EngineBase(model_dir, info, params.vllm, params.seed, at_once=4)
    job = EvaluationJob(params, verifier, sets, draft)
    alike = engine_kwargs(
        base, conversation_requests(job, tokenizer, max(k, ngram.k)), vllm_speculative_config(draft, k), ngram
    )
    prompts = {s.name: [s.render(c, 0, [], tokenizer) for c in s.conversations[: args.prompts]] for s in sets}
    every = [p for ps in prompts.values() for p in ps]
    # before: the plain engine logged no stats; the n-gram engine was sized for the timed turns one at a time
    one_request = base.kwargs(
        [request_tokens(len(p), s.params.max_new_tokens, ngram.k) for s in sets for p in prompts[s.name]]
    )
    old = {
        "plain": {key: value for key, value in alike["plain"].items() if key != "disable_log_stats"},
        "ngram": {**one_request, **{key: alike["ngram"][key] for key in DRAFTING_KEYS}},
    }
    kwargs = {
        "plain, alike": alike["plain"],
        "n-gram, alike": alike["ngram"],
        "plain, before": old["plain"],
        "n-gram, before": old["ngram"],
    }
    warm_up = sets[0].render(sets[0].conversations[-1], 0, [], tokenizer)
    engines = {}
    try:
        for name, each in kwargs.items():
            engines[name], _ = start_engine(each, "bench", name, warm_up, params.seed, every)
        timed = {}
        for eval_set in sets:
            sampling = sampling_params(eval_set.params.max_new_tokens, 0.0, params.seed)
            turns = time_interleaved(engines, prompts[eval_set.name], sampling, "bench", eval_set.name)
            timed[eval_set.name] = {name: tokens_and_seconds(pairs) for name, pairs in turns.items()}
    finally:
        for llm in engines.values():
            stop_engine(llm)

    def ratio(new: str, old_name: str) -> dict:
        entries = [{"turns": timed[s.name][new], "plain_turns": timed[s.name][old_name]} for s in sets]
        per_set = {
            s.name: pooled_speedup([e], params.bootstrap_samples, params.seed)
            for s, e in zip(sets, entries, strict=True)
        }
        return {"pooled": pooled_speedup(entries, params.bootstrap_samples, params.seed), "sets": per_set}

    figures = {
        "plain alike over before": ratio("plain, alike", "plain, before"),
        "n-gram alike over before": ratio("n-gram, alike", "n-gram, before"),
        "n-gram speed-up, alike": ratio("n-gram, alike", "plain, alike"),
        "n-gram speed-up, before": ratio("n-gram, before", "plain, before"),
    }
    record = {
        "command": " ".join(["bench/engines_alike.py", *sys.argv[1:]]),
        "commit": short_commit(),
        "host": host_record(alike["plain"]["dtype"]),
        "ngram": ngram.label,
        "max_num_seqs": {name: each.get("max_num_seqs") for name, each in kwargs.items()},
        "figures": figures,
        "timed": timed,
    }
    for name, figure in figures.items():
        value, half = figure["pooled"]
        print(
            f"{name:28s} x{value:.3f} ± {half:.3f}   "
            + "  ".join(f"{s} x{v:.3f} ± {h:.3f}" for s, (v, h) in figure["sets"].items())
        )
    print(record["host"]["key"])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.out, record)


if __name__ == "__main__":
    sys.exit(main())
