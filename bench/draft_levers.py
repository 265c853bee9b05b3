"""Benchmark (run by hand): what the draft's inputs, size, loss and data do to its acceptance, on three sets.

    .venv/bin/python bench/draft_levers.py capture     # once, after `dvc repro convert` (about 8 minutes here)
    .venv/bin/python bench/draft_levers.py train --aux 2,15,27 --steps 400 [--num-layers 2] [--loss-on all]
        [--train-fraction 0.5] [--total-seq-len 512] [--lr 1e-3]

`capture` stores the verifier's residual stream at many layers (default: most of them, and N, the final
norm's input) for every prepared row, and for two probe sets, each prompt followed by the verifier's own
greedy reply of evaluate.max_new_tokens tokens: `data/eval/general.jsonl` (the evaluate stage's general
set) and `bench/prompts/unseen.jsonl` (kinds the project never tunes on). They land in
bench/results/levers/ (about 1.9 GB for the demo's 800 rows).

`train` then trains speculators' draft (the train stage's `build_draft`, precision and learning-rate
schedule) on any aux layers among them, without re-extracting, and prints `tau_sim` (1 + a0 + a0*a1 + ...
from the conditional accuracies of the TTT steps, as the train stage reports it) on the mix's val split,
the general set and the unseen set every --every steps. The probe replies are the verifier's greedy ones,
so `tau_sim` there estimates what the evaluate stage decodes (it runs 0.1-0.15 above the decoded `tau`).
Results of the sweeps are in docs/experiments.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from eaglenest.artifacts.eval_params import EvalSetParams
from eaglenest.artifacts.eval_sets import load_eval_set
from eaglenest.artifacts.hidden_states.engines.hf import length_sorted_batches
from eaglenest.artifacts.verifier import load_verifier_info
from eaglenest.artifacts.vocab import load_rows, load_vocab
from eaglenest.commands.params_file import load_params
from eaglenest.core.chat import cut_after_end_of_turn, end_of_turn_ids
from eaglenest.core.decoder import capture_residual_stream, hidden_states_of_rows, load_decoder
from eaglenest.stages.train.data import PackedBatches, TrainingData, every_token_mask, pack_batches
from eaglenest.stages.train.model import build_draft, draft_runtime
from eaglenest.stages.train.optimization import build_optimization, train_step
from eaglenest.stages.train.validation import validate_draft

RESULTS = Path("bench/results/levers")
PROBES = {"general": Path("data/eval/general.jsonl"), "unseen": Path("bench/prompts/unseen.jsonl")}
DEFAULT_LAYERS = [1, 2, 3, 4, 6, 8, 10, 12, 15, 18, 21, 24, 26, 27, 28, 29]


def residual_streams(model: Any, layer_ids: list[int], sequences: list[list[int]]) -> list[torch.Tensor]:
    """``[len(seq), len(layer_ids), hidden]`` bf16 per sequence: the extract stage's hooks, many layers at once."""
    lengths = [len(s) for s in sequences]
    out: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
    with capture_residual_stream(model, layer_ids) as captured, torch.inference_mode():
        for batch in length_sorted_batches(list(range(len(sequences))), lengths, 8192):
            hidden = hidden_states_of_rows(
                model, captured, layer_ids, [sequences[i] for i in batch], 0, torch.device("cpu"), ""
            )
            for j, i in enumerate(batch):
                out[i] = hidden[j, : lengths[i]].to(torch.bfloat16).clone()
    return out


def capture(layers: list[int]) -> None:
    """Residual streams of the prepared rows and of the probe sets (prompt + the verifier's greedy reply)."""
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM, AutoTokenizer

    verifier, model_dir = load_verifier_info(Path("models/verifier"))
    layer_ids = sorted(set(layers) | {verifier.num_layers})
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    decoder = load_decoder(model_dir, verifier.trust_remote_code, torch.device("cpu"))
    lm = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, trust_remote_code=verifier.trust_remote_code
    ).eval()
    eos = end_of_turn_ids(tokenizer, model_dir)
    RESULTS.mkdir(parents=True, exist_ok=True)
    for name, path in PROBES.items():
        started = time.perf_counter()
        sequences, masks = [], []
        probe = load_eval_set(EvalSetParams(name=name, source=str(path)), Path("data/prepared"), tokenizer)
        for conversation in probe.conversations:
            ids = probe.render(conversation, 0, [], tokenizer)
            with torch.inference_mode():
                output = lm.generate(
                    torch.tensor([ids]),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    max_new_tokens=probe.params.max_new_tokens,
                    do_sample=False,
                    top_k=None,
                    top_p=None,
                    eos_token_id=sorted(eos),
                    pad_token_id=sorted(eos)[0],
                )
            reply = cut_after_end_of_turn(output[0, len(ids) :].tolist(), eos)
            sequences.append(ids + reply)
            masks.append([0] * len(ids) + [1] * len(reply))
        hidden = residual_streams(decoder, layer_ids, sequences)
        torch.save(
            {"input_ids": sequences, "loss_mask": masks, "hidden": hidden, "layer_ids": layer_ids},
            RESULTS / f"{name}.pt",
        )
        print(f"{name}: {len(sequences)} prompts with replies in {time.perf_counter() - started:.0f} s", flush=True)
    started = time.perf_counter()
    prepared = load_from_disk("data/prepared")
    sequences = [list(ids) for ids in prepared["input_ids"]]
    hidden = residual_streams(decoder, layer_ids, sequences)
    torch.save(
        {
            "input_ids": sequences,
            "loss_mask": [list(m) for m in prepared["loss_mask"]],
            "hidden": hidden,
            "layer_ids": layer_ids,
        },
        RESULTS / "prepared.pt",
    )
    print(f"prepared: {len(sequences)} rows in {time.perf_counter() - started:.0f} s", flush=True)


def load_captured(name: str, aux: list[int], final: int, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """One captured set as speculators' dataset items: aux layers concatenated ``[T, len(aux) * hidden]``."""
    stored = torch.load(RESULTS / f"{name}.pt", weights_only=True)
    missing = [a for a in aux + [final] if a not in stored["layer_ids"]]
    if missing:
        raise SystemExit(f"{RESULTS / name}.pt: layers {missing} were not captured (have {stored['layer_ids']})")
    slots = [stored["layer_ids"].index(a) for a in aux]
    items = []
    for ids, mask, hidden in zip(stored["input_ids"], stored["loss_mask"], stored["hidden"], strict=True):
        length = len(ids)
        items.append(
            {
                "input_ids": torch.tensor(ids),
                "loss_mask": torch.tensor(mask),
                "hidden_states": hidden[:, slots].reshape(length, -1).to(dtype),
                "verifier_last_hidden_states": hidden[:, stored["layer_ids"].index(final)].to(dtype),
                "lengths": torch.tensor([length]),
                "position_ids": torch.arange(length),
            }
        )
    return items


def train(args: argparse.Namespace) -> None:
    """Trains one draft on the captured streams and prints tau_sim on the three sets as it goes."""

    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    aux = [int(a) for a in args.aux.split(",")]
    params = load_params().train.model_copy(
        update={"steps": args.steps, "total_seq_len": args.total_seq_len, "lr": args.lr, "num_layers": args.num_layers}
    )
    verifier, model_dir = load_verifier_info(Path("models/verifier"))
    verifier = verifier.model_copy(update={"aux_layers": aux})
    vocab, d2t, t2d = load_vocab(Path("data/vocab"))
    runtime = draft_runtime(params, torch.device("cpu"))
    collate = CollateFn(
        max_len=params.total_seq_len,
        hidden_size=verifier.hidden_size,
        num_target_layers=len(aux),
        dtype=runtime.hs_dtype,
        preprocess=shift_batch,
    )

    rows = load_rows(Path("data/vocab"))
    items = load_captured("prepared", aux, verifier.num_layers, runtime.hs_dtype)
    train_rows = rows["train"][: int(len(rows["train"]) * args.train_fraction)]
    if args.loss_on == "all":  # as train.loss_tokens: all; the val rows keep the replies' mask
        for row in train_rows:
            items[row]["loss_mask"] = every_token_mask(items[row]["loss_mask"], params.ttt_steps)
    lengths = [len(item["input_ids"]) for item in items]
    data = TrainingData(
        items,
        collate,
        {"train": train_rows, "val": rows["val"]},
        lengths,
        online=None,
        loss_on_every_token=False,
        ttt_steps=params.ttt_steps,
    )  # the mask is set above
    sets = {"val": (data, pack_batches(rows["val"], lengths, params.total_seq_len, params.seed, 0))}
    for name in PROBES:
        probe = load_captured(name, aux, verifier.num_layers, runtime.hs_dtype)
        probe_lengths = [len(item["input_ids"]) for item in probe]
        probe_data = TrainingData(
            probe,
            collate,
            {"val": list(range(len(probe)))},
            probe_lengths,
            online=None,
            loss_on_every_token=False,
            ttt_steps=params.ttt_steps,
        )
        sets[name] = (
            probe_data,
            pack_batches(list(range(len(probe))), probe_lengths, params.total_seq_len, params.seed, 0),
        )

    model = build_draft(verifier, model_dir, params, vocab["draft_vocab_size"], d2t, t2d, runtime.attention)
    model.train()
    optimization = build_optimization(model, params)  # the train stage's optimizer, schedule and step
    batches = PackedBatches(train_rows, lengths, params.total_seq_len, params.seed).from_step(0)
    label = (
        f"aux={aux} layers={args.num_layers} loss_on={args.loss_on} train_rows={len(train_rows)} "
        f"precision={runtime.precision}"
    )
    started = time.perf_counter()
    for step in range(1, params.steps + 1):
        train_step(model, data.batch(next(batches), runtime.device), runtime, optimization, params)
        if step % args.every == 0 or step == params.steps:
            figures = []
            for name, (set_data, set_batches) in sets.items():
                result = validate_draft(model, set_data, set_batches, runtime)
                accuracies = " ".join(f"{a:.2f}" for a in result["val_cond_acc"])
                figures.append(f"{name} {result['tau_sim']:.3f} ({accuracies})")
            print(
                f"{label} step {step}: tau_sim " + " | ".join(figures) + f"  [{time.perf_counter() - started:.0f} s]",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    capture_args = commands.add_parser("capture", help="store many layers' residual streams (once)")
    capture_args.add_argument(
        "--layers",
        default=",".join(map(str, DEFAULT_LAYERS)),
        help="layer ids 1..N-1 to keep (N, the final norm's input, is always kept)",
    )
    train_args = commands.add_parser("train", help="train one draft on captured streams")
    train_args.add_argument("--aux", default="2,15,27", help="aux layer ids, each among the captured ones")
    train_args.add_argument("--steps", type=int, default=400)
    train_args.add_argument("--every", type=int, default=200, help="report every this many steps")
    train_args.add_argument("--num-layers", type=int, default=1, help="draft decoder layers")
    train_args.add_argument(
        "--loss-on",
        choices=["assistant", "all"],
        default="assistant",
        help="the loss on reply tokens only (as the train stage) or on every position",
    )
    train_args.add_argument("--train-fraction", type=float, default=1.0, help="train on this share of the rows")
    train_args.add_argument("--total-seq-len", type=int, default=512)
    train_args.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    if args.command == "capture":
        capture([int(layer) for layer in args.layers.split(",")])
    else:
        if not 0 < args.train_fraction <= 1:
            raise SystemExit(f"--train-fraction must be in (0, 1], got {args.train_fraction}")
        train(args)


if __name__ == "__main__":
    main()
