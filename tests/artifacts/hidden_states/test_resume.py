"""A running extraction checks its finished files against the plan the extract stage writes them from."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from eaglenest.artifacts.hidden_states.format import encode_hidden_states, extraction_fingerprint, recorded_in
from eaglenest.artifacts.hidden_states.layout import FileSink, FileWriter, HiddenStatePlan
from eaglenest.artifacts.hidden_states.resume import Extraction, unfinished_dir

PLAN = HiddenStatePlan(
    input_ids=[[1, 2, 3], [4, 5], [6]],
    rows_per_shard=2,
    layer_ids=[1, 2],
    hidden_size=4,
    verifier_fingerprint="verifier",
    dtype="float32",
    backend="hf",
)


def write_every_file(plan: HiddenStatePlan, folder: Path) -> None:
    """Each file of ``plan`` as the extract stage writes it, every row's hidden states zeros."""
    folder.mkdir(parents=True, exist_ok=True)
    for spec in plan.files:
        layout = plan.layout(spec)
        writer = FileWriter(layout, FileSink(layout, folder / spec.name))
        for row in spec.rows:
            zeros = torch.zeros(len(plan.input_ids[row]), plan.num_slots, plan.hidden_size)
            writer.write_row(row, encode_hidden_states(zeros, plan.dtype))
        writer.finish()


def test_files_written_from_the_plan_are_what_resume_keeps(tmp_path: Path):
    out = tmp_path / "hidden_states"
    write_every_file(PLAN, unfinished_dir(out))
    assert [spec.name for spec in PLAN.files] == ["shard_0.safetensors", "shard_1.safetensors"]
    assert (
        recorded_in(unfinished_dir(out) / "shard_0.safetensors", "config")
        == extraction_fingerprint("verifier", [1, 2], "float32")
        == PLAN.config
    )
    assert Extraction(out, PLAN).collect() == []


def test_a_plan_of_another_dtype_recomputes_every_file(tmp_path: Path):
    out = tmp_path / "hidden_states"
    write_every_file(PLAN, unfinished_dir(out))
    other = dataclasses.replace(PLAN, dtype="bfloat16")
    assert Extraction(out, other).collect() == other.files
