"""Benchmark (run by hand): the train stage on stored hidden-state files against ``extract.store: online``.

    .venv/bin/python bench/online_vs_stored.py --steps 40

Needs the demo's outputs up to `convert` (models/verifier, data/prepared, data/hidden_states, data/vocab).
Writes the online manifest into a temporary folder (what `extract` writes with `store: online`), then runs the
train stage's own loop (`train_draft`, validation at the end only) for --steps steps twice, on the same packed
batches: once reading data/hidden_states, once computing every batch's hidden states from the verifier. Prints
training tokens/s of each (validation excluded), their ratio, the two final losses and the largest weight
difference between the two drafts (relative to each tensor's largest value).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from safetensors.torch import load_file

from eaglenest.commands.params_file import load_params
from eaglenest.stages.extract import extract_hidden_states
from eaglenest.stages.train import TrainPaths, train_draft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    params = load_params()
    train = params.train.model_copy(update={"steps": args.steps, "eval_every": args.steps, "checkpoint_every": 10**6})
    results, drafts = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        manifest_dir = tmp / "online"
        extract_hidden_states(
            params.extract.model_copy(update={"store": "online"}),
            Path("models/verifier"),
            Path("data/prepared"),
            manifest_dir,
            tmp / "extract.json",
        )
        for name, hidden_states in (("stored", Path("data/hidden_states")), ("online", manifest_dir)):
            out = tmp / name
            results[name] = train_draft(
                train,
                TrainPaths(
                    verifier=Path("models/verifier"),
                    prepared=Path("data/prepared"),
                    hidden_states=hidden_states,
                    vocab=Path("data/vocab"),
                    out=out / "draft",
                    metrics=out / "train.json",
                    live_dir=out / "live",
                    checkpoints=out / "ck",
                ),
            )
            drafts[name] = load_file(out / "draft" / "model.safetensors")
    worst = 0.0
    for key, a in drafts["stored"].items():
        if a.is_floating_point():
            b = drafts["online"][key]
            worst = max(worst, float((a - b).abs().max()) / max(float(a.abs().max()), 1e-12))
    stored, online = results["stored"], results["online"]
    print(f"steps {args.steps}, total_seq_len {train.total_seq_len}, extract.dtype {params.extract.dtype}")
    print(
        f"stored: {stored['tokens_per_s']:.0f} tok/s, train loss {stored['train_loss']}, val loss "
        f"{stored['val_loss']}, tau_sim {stored['tau_sim']}"
    )
    print(
        f"online: {online['tokens_per_s']:.0f} tok/s, train loss {online['train_loss']}, val loss "
        f"{online['val_loss']}, tau_sim {online['tau_sim']}"
    )
    print(f"ratio online / stored: {online['tokens_per_s'] / stored['tokens_per_s']:.3f}")
    print(f"largest weight difference / tensor scale: {worst:.2e}")


if __name__ == "__main__":
    main()
