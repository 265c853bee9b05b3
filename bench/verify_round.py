"""Benchmark (run by hand): where a verify round's time goes, single-stream, for the plain, the draft's and the n-gram
engine, by sampling the engine with py-spy while it decodes evaluate's timed turns one at a time.

    .venv/bin/python bench/verify_round.py [--sets humaneval general long] [--prompts 4] [--rate 250] \\
        [--env KEY=VALUE] [--out bench/results/verify_round.json]

Run in a checkout whose pipeline is up to date (``models/verifier``, ``models/draft``, ``data/prepared``,
``metrics/free_sweep.json``). The three engines are evaluate's (:func:`eaglenest.stages.evaluate.vllm.
engine_kwargs`: one set of kwargs, the draft at its own K and n-gram at the free_sweep stage's setting), each
with its engine core in this process, so py-spy (``--nonblocking``, ``--rate`` samples a second) sees the engine's
step in this process's main thread. Each engine decodes the first ``--prompts`` turns of each set alone, twice:
once timed without the sampler attached (the seconds and verify rounds a round's cost is computed from), once
sampled. Each sample is put in the first category (:data:`CATEGORIES`, in priority order) that a frame of its
stack matches: the draft's own work (its model's forward, its input preparation and sampling), the rejection
sampler and sampler, the verifier's KV cache writes, attention, attention metadata, logits and other layers, the
model runner's input and output bookkeeping, the scheduler, the engine's output processing. The prefill is part of
the verifier's figures (each turn's first forward). A category's share of an engine's samples times the engine's
seconds, over its verify rounds, is that category's milliseconds per round. Writes one JSON record and prints a table.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# (category, pattern on a "function (file:line)" frame), in priority order: a sample is the first category one of its
# frames matches, wherever in the stack. The draft's work comes first: its model runs the same layer code as the
# verifier's.
CATEGORIES = [
    ("draft: model forward", r"llama_eagle3\.py|qwen3_dflash\.py|models/dflash\.py"),
    ("draft: proposer (inputs, metadata, sampling)", r"spec_decode/|_eagle_\w+_kernel_impl"),
    ("rejection sampler", r"rejection_sampler\.py"),
    ("sampler", r"v1/sample/"),
    ("verifier: KV cache write", r"do_kv_cache_update|reshape_and_cache"),
    ("verifier: attention", r"AttentionBackendImpl\.forward"),
    ("attention metadata", r"MetadataBuilder\.build|get_scheduler_metadata"),
    ("verifier: logits", r"compute_logits|logits_processor\.py"),
    ("verifier: layers (linear, norm, activation)", r"models/llama\.py"),
    (
        "model runner: inputs and outputs",
        r"worker/(gpu|cpu)_model_runner\.py|worker/gpu_input_batch\.py|"
        r"worker/cpu_worker|worker/gpu_worker",
    ),
    ("scheduler", r"core/sched/|core/kv_cache"),
    ("engine: outputs and requests", r"v1/engine/|entrypoints/llm\.py|outputs\.py"),
]


def category(stack: str) -> str:
    """The category of one collapsed stack (``frame;frame;...``, outermost first)."""
    frames = stack.split(";")
    for name, pattern in CATEGORIES:
        if any(re.search(pattern, frame) for frame in frames):
            return name
    return "other"


def sampled(pid: int, rate: int, out: Path) -> subprocess.Popen:
    """py-spy recording this process into ``out`` (raw collapsed stacks) until stopped with SIGINT."""
    spy = Path(sys.executable).with_name("py-spy")
    return subprocess.Popen(
        [
            str(spy),
            "record",
            "--pid",
            str(pid),
            "--rate",
            str(rate),
            "--format",
            "raw",
            "--nonblocking",
            "--output",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def read_stacks(path: Path) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            counts[category(stack)] += int(count)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", nargs="+", default=["humaneval", "general", "long"])
    parser.add_argument("--prompts", type=int, default=4, help="turns per set, each decoded alone (default: 4)")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples a second (default: 250)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="set before the engines")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    for pair in args.env:
        key, _, value = pair.partition("=")
        os.environ[key] = value

    from eaglenest.artifacts.draft import draft_tokens, vllm_speculative_config
    from eaglenest.artifacts.eval_sets import load_eval_sets
    from eaglenest.artifacts.free_record import measured_ngram
    from eaglenest.artifacts.verifier import load_tokenizer, load_verifier_info
    from eaglenest.commands.params_file import load_params
    from eaglenest.core.atomic import atomic_write_json
    from eaglenest.core.host import host_record, short_commit
    from eaglenest.core.measure.engines import EngineBase, sampling_params, start_engine, stop_engine
    from eaglenest.core.measure.single_stream import decode_alone
    from eaglenest.core.measure.spec_counters import request_counts
    from eaglenest.stages.evaluate.job import EvaluationJob
    from eaglenest.stages.evaluate.vllm import conversation_requests, engine_kwargs

    params = load_params("params.yaml").evaluate
    verifier, draft = Path("models/verifier"), Path("models/draft")
    tokenizer = load_tokenizer(verifier)
    sets = [s for s in load_eval_sets(params.sets, Path("data/prepared"), tokenizer) if s.name in args.sets]
    info, model_dir = load_verifier_info(verifier)
    k = draft_tokens(draft, "the draft")
    ngram = measured_ngram(info.fingerprint, k, Path("metrics/free_sweep.json")).setting
    base = EngineBase(model_dir, info, params.vllm, params.seed, at_once=3)
    job = EvaluationJob(params, verifier, sets, draft)
    kwargs = engine_kwargs(
        base, conversation_requests(job, tokenizer, max(k, ngram.k)), vllm_speculative_config(draft, k), ngram
    )
    turns = [(s, s.render(c, 0, [], tokenizer)) for s in sets for c in s.conversations[: args.prompts]]
    warm_up = sets[0].render(sets[0].conversations[-1], 0, [], tokenizer)

    record = {
        "command": " ".join(["bench/verify_round.py", *sys.argv[1:]]),
        "commit": short_commit(),
        "host": host_record(kwargs["plain"]["dtype"]),
        "k": k,
        "ngram": ngram.label,
        "env": args.env,
        "ld_preload": os.environ.get("LD_PRELOAD"),
        "turns": len(turns),
        "engines": {},
    }
    folder = Path(tempfile.mkdtemp(prefix="verify-round-"))

    def decode_all(llm: object, engine_k: int) -> tuple[float, int, int]:
        """Every turn alone: seconds, tokens and verify rounds (forwards after the prefill's: a drafting engine's
        counts say how many; plain decoding takes one per token after the first)."""
        seconds = tokens = rounds = 0
        for eval_set, prompt in turns:
            sampling = sampling_params(eval_set.params.max_new_tokens, 0.0, params.seed)
            ((output, spent),) = decode_alone(llm, [prompt], sampling, "bench")
            emitted = len(output.outputs[0].token_ids)
            counts = request_counts(output, engine_k) if engine_k else None
            rounds += counts.drafts if counts is not None and counts.drafts else emitted - 1
            seconds, tokens = seconds + spent, tokens + emitted
        return seconds, tokens, rounds

    for drafter, engine_k in (("plain", 0), ("spec", k), ("ngram", ngram.k)):
        llm, _ = start_engine(kwargs[drafter], "bench", drafter, warm_up, params.seed, [p for _, p in turns])
        try:
            seconds, tokens, rounds = decode_all(llm, engine_k)
            stacks = folder / f"{drafter}.txt"
            spy = sampled(os.getpid(), args.rate, stacks)
            time.sleep(1.0)  # py-spy attaches
            sampled_seconds, _, _ = decode_all(llm, engine_k)
            spy.send_signal(2)
            spy.wait(timeout=60)
        finally:
            stop_engine(llm)
        counts = read_stacks(stacks)
        total = sum(counts.values())
        record["engines"][drafter] = {
            "seconds": round(seconds, 3),
            "tokens": tokens,
            "verify_rounds": rounds,
            "ms_per_round": round(1000 * seconds / rounds, 3),
            "sampled_seconds": round(sampled_seconds, 3),
            "samples": total,
            "ms_per_round_by_part": {
                name: round(1000 * seconds * n / total / rounds, 3) for name, n in counts.most_common()
            },
        }
    plain_step = record["engines"]["plain"]["ms_per_round"]
    for drafter, entry in record["engines"].items():
        entry["plain_steps_per_round"] = round(entry["ms_per_round"] / plain_step, 3)
        print(
            f"{drafter:6s} {entry['tokens']:5d} tokens in {entry['verify_rounds']:5d} rounds, "
            f"{entry['ms_per_round']:.2f} ms a round ({entry['plain_steps_per_round']:.2f} plain steps)"
        )
        for name, ms in entry["ms_per_round_by_part"].items():
            print(f"    {name:48s} {ms:7.2f} ms")
    print(record["host"]["key"])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.out, record)


if __name__ == "__main__":
    sys.exit(main())
