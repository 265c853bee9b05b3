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


def row_values(plan: HiddenStatePlan, row: int) -> dict[str, torch.Tensor]:
    """Row ``row``'s stored tensors, distinct per row."""
    values = torch.full((len(plan.input_ids[row]), plan.num_slots, plan.hidden_size), float(row + 1))
    return encode_hidden_states(values, plan.dtype)


def test_a_shard_written_from_its_rows_in_parts_is_the_whole_file(tmp_path: Path):
    """Rows of a shard arriving in several parts, in any order, make the file one writer of all its rows makes; the
    file appears under its name only once its last row is in."""
    whole = tmp_path / "whole"
    whole.mkdir()
    spec = PLAN.files[0]
    layout = PLAN.layout(spec)
    writer = FileWriter(layout, FileSink(layout, whole / spec.name))
    for row in spec.rows:
        writer.write_row(row, row_values(PLAN, row))
    writer.finish()

    extraction = Extraction(tmp_path / "hidden_states", PLAN)
    extraction.collect()
    assert not extraction.accept_rows(spec, [(1, row_values(PLAN, 1))])
    assert not extraction.path(spec).exists() and spec.name not in extraction.finished
    assert extraction.accept_rows(spec, [(0, row_values(PLAN, 0))])
    assert extraction.path(spec).read_bytes() == (whole / spec.name).read_bytes()
    assert spec.name in extraction.finished and not extraction.writing


def test_a_stopped_run_leaves_nothing_of_a_shard_whose_rows_did_not_all_arrive(tmp_path: Path):
    extraction = Extraction(tmp_path / "hidden_states", PLAN)
    extraction.collect()
    extraction.accept_rows(PLAN.files[0], [(0, row_values(PLAN, 0))])
    assert len([path for path in extraction.dir.iterdir() if path.is_file()]) == 1  # its temporary file
    extraction.abort_unfinished()
    assert [path.name for path in extraction.dir.iterdir()] == ["earlier"]
    assert extraction.collect() == PLAN.files  # computed again
