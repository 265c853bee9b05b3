"""Benchmark (run by hand): training tokens/s against a bare forward+backward of the same draft and batches.

    .venv/bin/python bench/train_throughput.py --steps 6 --total-seq-len 2048 [--precision float32]

Needs `dvc repro convert` first. (a) the full train stage loop (`train_draft`: data loading through
speculators' ArrowDataset/CollateFn, bookkeeping, logging) for --steps steps without validation; (b) the
same draft's forward+backward+optimizer step on the same batches, collated beforehand and kept in memory.
Prints both tokens/s and their ratio (target >= 0.85).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from eaglenest.artifacts.verifier import load_verifier_info
from eaglenest.artifacts.vocab import load_vocab
from eaglenest.commands.params_file import load_params
from eaglenest.stages.train import TrainPaths, train_draft
from eaglenest.stages.train.data import load_training_data, pack_batches
from eaglenest.stages.train.model import build_draft, draft_runtime
from eaglenest.stages.train.optimization import build_optimization, train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--total-seq-len", type=int, default=None)
    parser.add_argument(
        "--precision", choices=["auto", "float32", "bfloat16"], default=None, help="override train.precision"
    )
    args = parser.parse_args()
    params = load_params().train
    updates = {"steps": args.steps, "eval_every": 10**6, "checkpoint_every": 10**6, "warmup_steps": 0}
    if args.total_seq_len:
        updates["total_seq_len"] = args.total_seq_len
    if args.precision:
        updates["precision"] = args.precision
    params = params.model_copy(update=updates)
    verifier, model_dir = load_verifier_info(Path("models/verifier"))
    vocab, d2t, t2d = load_vocab(Path("data/vocab"))
    runtime = draft_runtime(params, torch.device("cpu"))
    # The train stage's own data setup: speculators' ArrowDataset and CollateFn, its packing and order.
    data = load_training_data(
        params, verifier, Path("data/prepared"), Path("data/hidden_states"), Path("data/vocab"), runtime.hs_dtype
    )
    batches = pack_batches(data.rows["train"], data.lengths, params.total_seq_len, params.seed, 0)[: args.steps]
    tokens = sum(data.lengths[r] for b in batches for r in b)

    # (b) bare: batches collated up front, then only forward + backward + optimizer step.
    collated = [data.batch(b, runtime.device) for b in batches]
    model = build_draft(verifier, model_dir, params, vocab["draft_vocab_size"], d2t, t2d, runtime.attention)
    optimization = build_optimization(model, params)
    started = time.perf_counter()
    for batch in collated:  # the stage's own step (train.precision's autocast, clipping, schedule)
        train_step(model, batch, runtime, optimization, params)
    bare = time.perf_counter() - started

    # (a) the stage's own loop over the same batches (same seed, epoch 0, first --steps batches).
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        metrics = train_draft(
            params,
            TrainPaths(
                verifier=Path("models/verifier"),
                prepared=Path("data/prepared"),
                hidden_states=Path("data/hidden_states"),
                vocab=Path("data/vocab"),
                out=tmp / "draft",
                metrics=tmp / "train.json",
                live_dir=tmp / "live",
                checkpoints=tmp / "ck",
            ),
        )
    loop_tokens_per_s = metrics["tokens_per_s"]  # includes the final validation; see note in README
    print(
        f"steps {args.steps}, total_seq_len {params.total_seq_len}, tokens {tokens}, "
        f"threads {torch.get_num_threads()}, precision {runtime.precision}"
    )
    print(f"bare forward+backward+step: {tokens / bare:.0f} tok/s")
    print(f"train stage loop: {loop_tokens_per_s:.0f} tok/s")
    print(f"ratio loop / bare: {loop_tokens_per_s / (tokens / bare):.3f}")


if __name__ == "__main__":
    main()
