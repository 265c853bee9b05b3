"""Benchmark (run by hand): extraction throughput against a bare decoder forward over the same batches.

    .venv/bin/python bench/extract_throughput.py --rows 128 [--dtype float8_e4m3fn]

Needs `dvc repro prepare` first (reads models/verifier and data/prepared). Prints tokens/s of (a) the
verifier's decoder alone (no hooks, no LM head, nothing written) and (b) eaglenest's hf extraction
(hooks, stacking, bf16 conversion, atomic file writes), their ratio (target >= 0.9) and the peak RSS.
Bare passes run before and after the extraction, so drift of the machine shows up.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import torch
from datasets import load_from_disk

from eaglenest.artifacts.hidden_states.engines.contract import EngineSettings
from eaglenest.artifacts.hidden_states.engines.hf import HfEngine, length_sorted_batches
from eaglenest.artifacts.hidden_states.format import extraction_fingerprint, file_metadata
from eaglenest.artifacts.hidden_states.layout import ShardSpec, file_layout
from eaglenest.artifacts.verifier import load_verifier_info
from eaglenest.commands.params_file import load_params
from eaglenest.core.decoder import load_decoder, pad_batch
from eaglenest.stages.extract.job import ExtractTask, run_extract_task


def bare_forward(model: torch.nn.Module, batches: list[list[int]], input_ids: list[list[int]]) -> float:
    """Seconds for the decoder alone over the batches."""
    pad_id = getattr(model.config, "pad_token_id", None) or 0
    started = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            ids, mask = pad_batch([input_ids[r] for r in batch], pad_id)
            model(input_ids=ids, attention_mask=mask, use_cache=False)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=128, help="prepared rows to use")
    parser.add_argument("--verifier", default="models/verifier")
    parser.add_argument("--prepared", default="data/prepared")
    parser.add_argument("--dtype", default=None, help="storage dtype (default: extract.dtype from params.yaml)")
    args = parser.parse_args()

    params = load_params().extract
    if args.dtype:
        params = params.model_copy(update={"dtype": args.dtype})
    verifier, model_dir = load_verifier_info(Path(args.verifier))
    input_ids = load_from_disk(args.prepared).data.column("input_ids").to_pylist()
    rows = list(range(min(args.rows, len(input_ids))))
    tokens = sum(len(input_ids[r]) for r in rows)
    batches = length_sorted_batches(rows, [len(x) for x in input_ids], params.batch_tokens)
    model = load_decoder(model_dir, verifier.trust_remote_code, torch.device("cpu"))
    bare_forward(model, batches[:1], input_ids)  # warm-up

    bare_before = bare_forward(model, batches, input_ids)
    with tempfile.TemporaryDirectory() as tmp:
        config = extraction_fingerprint(verifier.fingerprint, verifier.layer_ids, params.dtype)
        metadata = file_metadata(config, verifier.layer_ids, params.dtype, "hf")
        # the rows as one task (one shard), so its batches are the bare passes' batches
        layout = file_layout(
            ShardSpec(0, range(len(rows)), len(rows)),
            [input_ids[r] for r in rows],
            len(verifier.layer_ids),
            verifier.hidden_size,
            params.dtype,
            metadata,
        )
        engine = HfEngine(EngineSettings(verifier, model_dir, params, max(len(input_ids[r]) for r in rows)))
        started = time.perf_counter()
        ((_, path),) = run_extract_task(engine, ExtractTask((layout,), params.dtype, Path(tmp)))
        extract_seconds = time.perf_counter() - started  # the engine loaded its model before the clock started
        written = path.stat().st_size
    bare_after = bare_forward(model, batches, input_ids)
    bare = (bare_before + bare_after) / 2

    print(
        f"rows {len(rows)}, tokens {tokens}, batches {len(batches)} (batch_tokens {params.batch_tokens}), "
        f"torch threads {torch.get_num_threads()}"
    )
    print(f"bare decoder forward: {tokens / bare_before:.0f} tok/s before, {tokens / bare_after:.0f} tok/s after")
    print(
        f"extraction (hf, {params.dtype}): {tokens / extract_seconds:.0f} tok/s "
        f"(model load excluded), {written / tokens:.0f} bytes/token"
    )
    print(f"ratio extraction / bare: {bare / extract_seconds:.3f}")
    print(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
