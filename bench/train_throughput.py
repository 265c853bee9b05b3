"""Benchmark (run by hand): training tokens/s against a bare forward+backward of the same draft and batches.

    .venv/bin/python bench/train_throughput.py --steps 6 --total-seq-len 2048

Needs `dvc repro convert` first. (a) the full train stage loop (`train_draft`: data loading through
speculators' ArrowDataset/CollateFn, bookkeeping, logging) for --steps steps without validation; (b) the
same draft's forward+backward+optimizer step on the same batches, collated beforehand and kept in memory.
Prints both tokens/s and their ratio (target >= 0.85).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from datasets import load_from_disk

from eaglenest.convert import ROWS_FILE, load_vocab
from eaglenest.params import load_params
from eaglenest.train import TrainInputs, build_draft, pack_batches, train_draft
from eaglenest.verifier import load_verifier_info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--total-seq-len", type=int, default=None)
    args = parser.parse_args()
    params = load_params().train
    updates = {"steps": args.steps, "eval_every": 10**6, "checkpoint_every": 10**6, "warmup_steps": 0}
    if args.total_seq_len:
        updates["total_seq_len"] = args.total_seq_len
    params = params.model_copy(update=updates)
    from hs_connectors import FileTransfer
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn

    verifier, model_dir = load_verifier_info(Path("models/verifier"))
    vocab, d2t, t2d = load_vocab(Path("data/vocab"))
    rows = json.loads((Path("data/vocab") / ROWS_FILE).read_text())
    lengths = load_from_disk("data/prepared").data.column("seq_len").to_pylist()
    batches = pack_batches(rows["train"], lengths, params.total_seq_len, params.seed, 0)[: args.steps]
    tokens = sum(lengths[r] for b in batches for r in b)

    # (b) bare: batches collated up front, then only forward + backward + optimizer step.
    dataset = ArrowDataset(max_len=params.total_seq_len, datapath="data/prepared",
                           transfer=FileTransfer(Path("data/hidden_states")), on_missing="raise",
                           hidden_states_dtype=torch.float32)
    collate = CollateFn(max_len=params.total_seq_len, hidden_size=verifier.hidden_size,
                        num_target_layers=len(verifier.aux_layers), dtype=torch.float32,
                        preprocess=shift_batch)
    collated = [collate([dataset[i] for i in b]) for b in batches]
    model = build_draft(verifier, model_dir, params, vocab["draft_vocab_size"], d2t, t2d, "sdpa")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=params.lr)
    kwargs = {"ttt_steps": params.ttt_steps, "ttt_step_loss_decay": 1.0,
              "loss_config": resolve_loss_config(params.loss, "eager")}
    started = time.perf_counter()
    for batch in collated:
        _, loss, _ = model(**batch, **kwargs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    bare = time.perf_counter() - started

    # (a) the stage's own loop over the same batches (same seed, epoch 0, first --steps batches).
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        metrics = train_draft(params, TrainInputs(
            verifier=Path("models/verifier"), prepared=Path("data/prepared"),
            hidden_states=Path("data/hidden_states"), vocab=Path("data/vocab"), out=tmp / "draft",
            metrics=tmp / "train.json", live_dir=tmp / "live", checkpoints=tmp / "ck"))
    loop_tokens_per_s = metrics["tokens_per_s"]  # includes the final validation; see note in README
    print(f"steps {args.steps}, total_seq_len {params.total_seq_len}, tokens {tokens}, "
          f"threads {torch.get_num_threads()}")
    print(f"bare forward+backward+step: {tokens / bare:.0f} tok/s")
    print(f"train stage loop: {loop_tokens_per_s:.0f} tok/s")
    print(f"ratio loop / bare: {loop_tokens_per_s / (tokens / bare):.3f}")


if __name__ == "__main__":
    main()
