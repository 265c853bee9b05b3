"""Benchmark (run by hand): bytes per token of the hidden-state files in each storage dtype, measured on this
repository's verifier and prepared rows, and projected to larger verifiers.

    .venv/bin/python bench/storage.py --rows 64

Needs `dvc repro prepare` first (models/verifier, data/prepared). Extracts the first --rows prepared rows with
the hf back end in float32, bfloat16 and float8_e4m3fn into temporary folders, prints the measured bytes
per token and the seconds each took, then the projection per million tokens for Llama-3.1-8B (hidden 4096)
and a Kimi-K2.5-class verifier (hidden 7168), four stored slots each (three aux layers and the last).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from datasets import load_from_disk

from eaglenest.artifacts.prepared import write_prepared
from eaglenest.artifacts.verifier import load_verifier_info
from eaglenest.commands.params_file import load_params
from eaglenest.stages.extract import extract_hidden_states

DTYPES = {"float32": 4, "bfloat16": 2, "float8_e4m3fn": 1}  # bytes per stored value
# Per token besides the values: the int64 token id, and for fp8 its float32 scale.
EXTRA = {"float32": 8, "bfloat16": 8, "float8_e4m3fn": 12}
VERIFIERS = {"Llama-3.1-8B": 4096, "Kimi-K2.5 class (DeepSeek-V3 shape)": 7168}
SLOTS = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    args = parser.parse_args()
    params = load_params().extract
    verifier, _ = load_verifier_info(Path("models/verifier"))
    table = load_from_disk("data/prepared").with_format(None)
    rows = min(args.rows, len(table))
    ids, masks = table[:rows]["input_ids"], table[:rows]["loss_mask"]
    print(
        f"verifier {verifier.name}: hidden {verifier.hidden_size}, {len(verifier.layer_ids)} slots; {rows} rows, "
        f"{sum(map(len, ids))} tokens"
    )
    measured = {}
    with tempfile.TemporaryDirectory() as tmp:
        prepared = Path(tmp) / "prepared"
        write_prepared(prepared, ids, masks, train_rows=rows - 1, val_prompts=[])
        for dtype in DTYPES:
            metrics = extract_hidden_states(
                params.model_copy(update={"dtype": dtype, "backend": "hf"}),
                Path("models/verifier"),
                prepared,
                Path(tmp) / dtype,
                Path(tmp) / f"{dtype}.json",
            )
            measured[dtype] = metrics
            formula = len(verifier.layer_ids) * verifier.hidden_size * DTYPES[dtype] + EXTRA[dtype]
            print(
                f"{dtype:14s} {metrics['bytes_per_token']:9.1f} bytes/token measured ({formula} by the formula, "
                f"the rest is the file header), {metrics['seconds']:.1f} s"
            )
    print(f"\nprojected per million tokens ({SLOTS} slots): GB on disk")
    for name, hidden in VERIFIERS.items():
        cells = [f"{dtype} {(SLOTS * hidden * DTYPES[dtype] + EXTRA[dtype]) / 1e3:.1f}" for dtype in DTYPES]
        print(f"  {name} (hidden {hidden}): " + ", ".join(cells) + ", online 0")
    print(json.dumps({d: {k: m[k] for k in ("bytes_per_token", "seconds", "tokens")} for d, m in measured.items()}))


if __name__ == "__main__":
    main()
