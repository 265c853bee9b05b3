"""GPU check (one GPU, after `pip install -e '.[vllm]'`): hf and vllm back ends agree.

    bash scripts/gpu_check.sh            # or: python scripts/gpu_check.py --rows 32 --work /tmp/gpu-check

Builds the default verifier (SmolLM2-135M-Instruct), prepares ``--rows`` chitchat conversations, extracts
their hidden states with both back ends in bf16, and compares every layer slot of every row. Prints one
line per layer slot (cosine similarity, relative mean abs difference) and exits non-zero if any slot is
outside the bf16 tolerance. Then trains a short draft on the GPU and evaluates it with both back ends
(transformers reference and vLLM's own EAGLE-3 with its spec-decode counters), printing both metric sets.
Budget: under 10 minutes, most of it vLLM's start-ups.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from eaglenest.convert import convert
from eaglenest.evaluate import evaluate
from eaglenest.extract import extract_hidden_states
from eaglenest.hidden_states import hs_path
from eaglenest.params import ConvertParams, EvaluateParams, ExtractParams, PrepareParams, TrainParams, VerifierParams
from eaglenest.prepare import end_of_turn_ids, prepare_dataset
from eaglenest.train import TrainInputs, train_draft
from eaglenest.verifier import build_verifier, load_tokenizer, load_verifier_info

# bf16 kernels differ between transformers and vLLM (fused norms, attention); these bound honest noise.
MIN_COSINE = 0.995
MAX_RELATIVE_DIFF = 0.03


def compare(dir_a: Path, dir_b: Path, rows: int, layer_ids: list[int]) -> list[dict]:
    """Per layer slot: worst cosine similarity over rows, and mean |a-b| / mean |a|."""
    results = []
    for slot, layer in enumerate(layer_ids):
        cosines, diffs, scales = [], 0.0, 0.0
        for row in range(rows):
            a = load_file(hs_path(dir_a, row))["hidden_states"][:, slot].float()
            b = load_file(hs_path(dir_b, row))["hidden_states"][:, slot].float()
            cosines.append(torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item())
            diffs += (a - b).abs().mean().item()
            scales += a.abs().mean().item()
        results.append({"layer": layer, "min_cosine": min(cosines), "relative_diff": diffs / scales})
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--work", type=Path, default=Path("/tmp/eaglenest-gpu-check"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no GPU visible to torch", file=sys.stderr)
        return 2
    started = time.perf_counter()
    verifier_dir, prepared = args.work / "verifier", args.work / "prepared"
    build_verifier(VerifierParams(), verifier_dir)
    tokenizer = load_tokenizer(verifier_dir)
    _, model_dir = load_verifier_info(verifier_dir)
    prepare_dataset(PrepareParams(max_conversations=args.rows, max_len=512), tokenizer, prepared,
                    args.work / "prepare.json", end_of_turn_ids(tokenizer, model_dir))
    outputs = {}
    for backend in ("hf", "vllm"):
        params = ExtractParams(backend=backend, dtype="bfloat16", device="cuda" if backend == "hf" else "auto")
        out = args.work / f"hs_{backend}"
        outputs[backend] = extract_hidden_states(params, verifier_dir, prepared, out, args.work / f"{backend}.json")
        print(f"{backend}: {json.dumps(outputs[backend])}")
    info, _ = load_verifier_info(verifier_dir)
    failed = False
    for result in compare(args.work / "hs_hf", args.work / "hs_vllm", outputs["hf"]["rows"], info.layer_ids):
        ok = result["min_cosine"] >= MIN_COSINE and result["relative_diff"] <= MAX_RELATIVE_DIFF
        failed |= not ok
        print(f"layer {result['layer']:>3}: min cosine {result['min_cosine']:.5f}, "
              f"relative mean abs diff {result['relative_diff']:.4f} {'ok' if ok else 'FAIL'}")
    # A short draft trained on the GPU, then evaluated by both back ends on the same prompts.
    convert(ConvertParams(), "bfloat16", verifier_dir, prepared, args.work / "hs_hf", args.work / "vocab",
            args.work / "data.json")
    train_draft(TrainParams(steps=60, eval_every=30, total_seq_len=2048), TrainInputs(
        verifier=verifier_dir, prepared=prepared, hidden_states=args.work / "hs_hf", vocab=args.work / "vocab",
        out=args.work / "draft", metrics=args.work / "train.json", live_dir=args.work / "live",
        checkpoints=args.work / "ck"))
    for backend in ("hf", "vllm"):
        params = EvaluateParams(backend=backend, num_prompts=8, max_new_tokens=64, prompts=None)
        metrics = evaluate(params, verifier_dir, prepared, args.work / "draft", args.work / f"eval_{backend}.json",
                           args.work / f"eval_plots_{backend}")
        print(f"evaluate {backend}: {json.dumps(metrics)}")
        failed |= metrics["lossless_fraction"] < 1.0 if backend == "hf" else metrics["tau"] < 1.0
    print(f"gpu_check: {'FAIL' if failed else 'PASS'} in {time.perf_counter() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
