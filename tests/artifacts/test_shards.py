"""Hidden-state shards (extract.rows_per_shard > 1): the same rows as per-row files, resume, re-sharding, convert's
row-level checks, training reads, multi-node parts on shard boundaries."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eaglenest.artifacts.hidden_states import (
    ROW_INDEX_KEY,
    hs_path,
    read_shard_row,
    shard_path,
    shard_row_index,
    stored_files,
)
from eaglenest.core.errors import InputFileError
from eaglenest.core.params import ConvertParams, ExtractParams, TrainParams
from eaglenest.stages.convert import convert
from eaglenest.stages.extract import extract_hidden_states, part_rows
from tests.fixtures.pipeline import pipeline_until_prepare

ROWS = 10


@pytest.fixture
def prepared(tmp_path: Path, tiny_verifier_dir: Path) -> tuple[Path, Path]:
    return pipeline_until_prepare(tmp_path, tiny_verifier_dir, rows=ROWS)


def extract(prepared: tuple[Path, Path], out: Path, rows_per_shard: int = 1, **params) -> dict:
    """The extract stage; row files unless ``rows_per_shard`` says otherwise (the default packs 256)."""
    verifier_dir, prepared_dir = prepared
    return extract_hidden_states(ExtractParams(rows_per_shard=rows_per_shard, **params), verifier_dir, prepared_dir,
                                 out, out.parent / "m.json")


def folder(out: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(out.iterdir())}


def shard_rows_as_stored(out: Path, shard: int) -> dict[int, dict[str, torch.Tensor]]:
    index = shard_row_index(shard_path(out, shard))
    with safe_open(str(shard_path(out, shard)), framework="pt") as handle:
        return {row: read_shard_row(handle, *index[row]) for row in index}


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_shards_hold_exactly_the_row_files_rows(tmp_path: Path, prepared, dtype: str):
    rows_dir, shards_dir = tmp_path / "rows", tmp_path / "shards"
    extract(prepared, rows_dir, dtype=dtype)
    metrics = extract(prepared, shards_dir, dtype=dtype, rows_per_shard=4)
    # 10 rows in shards of 4: 4 + 4 + 2, and no row file left
    assert [p.name for p in stored_files(shards_dir)] == [f"shard_{s}.safetensors" for s in range(3)]
    assert metrics["files"] == 3 and metrics["rows"] == ROWS and metrics["rows_per_shard"] == 4
    for shard in range(3):
        for row, stored in shard_rows_as_stored(shards_dir, shard).items():
            assert row // 4 == shard
            expected = load_file(hs_path(rows_dir, row))
            assert stored.keys() == expected.keys()  # fp8 keeps its per-token scales
            for key in expected:
                assert stored[key].dtype == expected[key].dtype and torch.equal(stored[key].view(torch.uint8),
                                                                                expected[key].view(torch.uint8))
    header = json.loads(safe_open(str(shard_path(shards_dir, 2)), framework="pt").metadata()["eaglenest"])
    assert header["rows_per_shard"] == 4 and header["shard"] == 2 and header["dtype"] == dtype


def test_an_interrupted_extraction_keeps_finished_shards_and_row_files(tmp_path: Path, prepared):
    fresh = tmp_path / "fresh"
    extract(prepared, fresh, rows_per_shard=4)
    out = tmp_path / "hs"
    # a run killed after rows 0..4: their row files (as any back end writes them), shard 0 not yet packed
    extract(prepared, out)
    for row in range(5, ROWS):
        hs_path(out, row).unlink()
    metrics = extract(prepared, out, rows_per_shard=4)
    assert metrics["rows_computed"] == 5 and metrics["rows_reused"] == 5
    assert folder(out) == folder(fresh)  # the same bytes as an uninterrupted run

    # killed while packing shard 1: the shard and its row files both on disk; and shard 2 truncated
    for row, stored in shard_rows_as_stored(out, 1).items():
        tokens = stored.pop("token_ids")
        save_file({**stored, "token_ids": tokens}, hs_path(out, row))
    data = shard_path(out, 2).read_bytes()
    shard_path(out, 2).write_bytes(data[:-10])
    untouched = shard_path(out, 0).stat().st_mtime_ns
    metrics = extract(prepared, out, rows_per_shard=4)
    assert metrics["rows_computed"] == 2  # shard 2's rows only
    assert folder(out) == folder(fresh) and shard_path(out, 0).stat().st_mtime_ns == untouched


def test_a_changed_shard_size_reshards_without_recomputing(tmp_path: Path, prepared):
    out = tmp_path / "hs"
    extract(prepared, out, rows_per_shard=4)
    for size, files in ((3, 4), (1, ROWS), (5, 2)):
        fresh = tmp_path / f"fresh-{size}"
        extract(prepared, fresh, rows_per_shard=size)
        metrics = extract(prepared, out, rows_per_shard=size)
        assert metrics["rows_computed"] == 0 and len(stored_files(out)) == files
        assert folder(out) == folder(fresh), size


def test_shards_of_another_dtype_are_recomputed(tmp_path: Path, prepared):
    out = tmp_path / "hs"
    extract(prepared, out, rows_per_shard=4)
    metrics = extract(prepared, out, rows_per_shard=4, dtype="float32")
    assert metrics["rows_computed"] == ROWS and len(stored_files(out)) == 3


def run_convert(prepared: tuple[Path, Path], hs: Path, root: Path, rows_per_shard: int = 4, **params) -> dict:
    verifier_dir, prepared_dir = prepared
    return convert(ConvertParams(draft_vocab_size=64, **params), ExtractParams(rows_per_shard=rows_per_shard),
                   verifier_dir, prepared_dir, hs, root / "vocab", root / "data.json")


def rewrite_shard(path: Path, change) -> None:
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata=metadata)


def test_convert_names_a_bad_row_by_its_shard_and_skip_excludes_only_that_row(tmp_path: Path, prepared):
    out = tmp_path / "hs"
    extract(prepared, out, rows_per_shard=4)
    first, _ = shard_row_index(shard_path(out, 1))[6]

    def nan_in_row_6(tensors: dict) -> None:
        tensors["hidden_states"][first + 1, 2, 3] = float("nan")

    rewrite_shard(shard_path(out, 1), nan_in_row_6)
    with pytest.raises(InputFileError) as err:
        run_convert(prepared, out, tmp_path)
    assert f"{shard_path(out, 1)} row 6: 1 non-finite values (first at token 1, slot 2)" in str(err.value)
    metrics = run_convert(prepared, out, tmp_path, on_bad="skip")
    assert metrics["excluded_rows"] == [6] and metrics["samples"] == ROWS - 1


def test_convert_refuses_files_of_another_shard_size_in_one_line(tmp_path: Path, prepared):
    verifier_dir, prepared_dir = prepared
    rows_dir, shards_dir = tmp_path / "rows", tmp_path / "shards"
    extract(prepared, rows_dir)
    extract(prepared, shards_dir, rows_per_shard=4)
    for hs, size, message in [
        (rows_dir, 4, r"rows: 10 row files \(hs_\{i\}.safetensors\), written with extract.rows_per_shard = 1, now 4; "
                      r"run `dvc repro extract`: it re-shards the rows without recomputing them"),
        (shards_dir, 1, r"shard_0.safetensors: written with extract.rows_per_shard = 4, now 1; run `dvc repro"),
        (shards_dir, 8, r"shard_0.safetensors: written with extract.rows_per_shard = 4, now 8; run `dvc repro"),
    ]:
        with pytest.raises(InputFileError, match=message) as err:
            convert(ConvertParams(draft_vocab_size=64, on_bad="skip"), ExtractParams(rows_per_shard=size),
                    verifier_dir, prepared_dir, hs, tmp_path / "vocab", tmp_path / "data.json")
        assert "\n" not in str(err.value) and not (tmp_path / "vocab").exists()
    # the fix the line gives: extract at the new size re-shards without recomputing, then convert passes
    assert extract(prepared, shards_dir, rows_per_shard=8)["rows_computed"] == 0
    convert(ConvertParams(draft_vocab_size=64), ExtractParams(rows_per_shard=8), verifier_dir, prepared_dir,
            shards_dir, tmp_path / "vocab", tmp_path / "data.json")


@pytest.mark.parametrize(("change", "message"), [
    ("index", "its row index disagrees with its tensors at row 5"),
    ("truncated", "(truncated?)"),
])
def test_convert_refuses_a_bad_shard_naming_it(tmp_path: Path, prepared, change: str, message: str):
    out = tmp_path / "hs"
    extract(prepared, out, rows_per_shard=4)
    if change == "index":
        def shift(tensors: dict) -> None:
            tensors[ROW_INDEX_KEY][1, 1] += 1  # row 5 said to start a token later

        rewrite_shard(shard_path(out, 1), shift)
    elif change == "truncated":
        shard_path(out, 1).write_bytes(shard_path(out, 1).read_bytes()[:-10])
    with pytest.raises(InputFileError) as err:
        run_convert(prepared, out, tmp_path, rows_per_shard=4)
    assert message in str(err.value) and "shard_1.safetensors row" in str(err.value)


def test_training_reads_the_same_rows_from_shards(tmp_path: Path, prepared, tiny_verifier_dir: Path):
    from eaglenest.artifacts.verifier import load_verifier_info
    from eaglenest.stages.train.data import load_training_data

    verifier_dir, prepared_dir = prepared
    verifier, _ = load_verifier_info(verifier_dir)
    items = {}
    for size in (1, 4):
        out = tmp_path / f"hs-{size}"
        extract(prepared, out, rows_per_shard=size)
        run_convert(prepared, out, tmp_path / f"c-{size}", rows_per_shard=size)
        data = load_training_data(TrainParams(), verifier, prepared_dir, out, tmp_path / f"c-{size}" / "vocab",
                                  torch.float32)
        items[size] = [data.dataset[row] for row in range(ROWS)]
    for from_rows, from_shards in zip(items[1], items[4], strict=True):
        assert from_rows.keys() == from_shards.keys()
        for key, value in from_rows.items():
            assert torch.equal(value, from_shards[key]), key


def test_parts_start_on_shard_boundaries_and_join(tmp_path: Path, prepared):
    assert [part_rows(10, rank, 3) for rank in range(3)] == [range(0, 3), range(3, 6), range(6, 10)]
    assert [part_rows(10, rank, 3, 4) for rank in range(3)] == [range(0, 4), range(4, 8), range(8, 10)]
    assert [part_rows(10, rank, 2, 4) for rank in range(2)] == [range(0, 4), range(4, 10)]
    out, fresh = tmp_path / "hs", tmp_path / "fresh"
    extract(prepared, fresh, rows_per_shard=4)
    for rank in (1, 0):
        metrics = extract(prepared, out, rows_per_shard=4, rank=rank, world_size=2)
        assert metrics["rows"] == (4 if rank == 0 else 6)
    joined = extract(prepared, out, rows_per_shard=4)
    assert joined["rows_computed"] == 0 and folder(out) == folder(fresh)


def test_more_nodes_than_shards_leave_a_part_empty_and_still_join(tmp_path: Path, prepared, caplog):
    """10 rows in shards of 8 are 2 shards for 3 nodes: one node gets none, finishes, and the join is whole."""
    assert [part_rows(10, rank, 3, 8) for rank in range(3)] == [range(0, 0), range(0, 8), range(8, 10)]
    out, fresh = tmp_path / "hs", tmp_path / "fresh"
    extract(prepared, fresh, rows_per_shard=8)
    empty = extract(prepared, out, rows_per_shard=8, rank=0, world_size=3)
    assert (empty["rows"], empty["files"], empty["bytes_per_token"]) == (0, 0, None)
    assert "part 0/3 holds no whole shard" in caplog.text
    for rank in (2, 1):
        extract(prepared, out, rows_per_shard=8, rank=rank, world_size=3)
    joined = extract(prepared, out, rows_per_shard=8)
    assert joined["rows_computed"] == 0 and folder(out) == folder(fresh)


def test_export_writes_speculators_layout_equal_to_row_files(tmp_path: Path, prepared, capsys):
    from datasets import load_from_disk
    from hs_connectors import FileTransfer
    from speculators.data_generation.offline import check_hidden_states

    from eaglenest.commands.cli import main as cli_main
    from eaglenest.commands.inspect import inspect_path

    rows_dir, shards_dir, out = tmp_path / "rows", tmp_path / "shards", tmp_path / "export"
    extract(prepared, rows_dir)
    extract(prepared, shards_dir, rows_per_shard=4)
    status = cli_main(["export", "--format", "speculators", "--prepared", str(prepared[1]), "--hidden-states",
                       str(shards_dir), "--out", str(out)])
    assert status == 0 and f"exported {ROWS} rows" in capsys.readouterr().out
    assert folder(out / "hidden_states") == folder(rows_dir)  # the bytes extract writes with rows_per_shard: 1
    assert (out / "dataset_info.json").is_file()
    assert FileTransfer(out / "hidden_states").get_cached(3)["token_ids"].numel() > 0
    # speculators' own check of a hidden-state file against its row's tokens, file by file
    exported_rows = load_from_disk(str(out)).with_format(None)["input_ids"]
    assert len(exported_rows) == ROWS
    for row, input_ids in enumerate(exported_rows):
        check_hidden_states(load_file(hs_path(out / "hidden_states", row)), input_ids)

    described = "\n".join(inspect_path(shard_path(shards_dir, 1)))
    assert "shard of 4 rows (4..7)" in described and "row 4: hidden_states bfloat16" in described
    assert "slot 3:" in described and "DISAGREES" not in described
    assert "3 shards" in "\n".join(inspect_path(shards_dir))


def test_rows_finishing_out_of_order_are_packed_when_their_shard_completes(tmp_path: Path, prepared,
                                                                           monkeypatch: pytest.MonkeyPatch):
    """As vLLM's requests finish: each shard appears exactly when the last of its rows is written."""
    import eaglenest.stages.extract as extract_stage

    seen: list[int] = []

    def out_of_order(job) -> None:
        order = list(job.todo)
        random.Random(1).shuffle(order)
        for row in order:
            hidden = torch.randn(len(job.input_ids[row]), len(job.verifier.layer_ids), job.verifier.hidden_size)
            job.write(row, hidden)
            seen.append(row)
            for shard in range(3):
                rows = range(4 * shard, min(4 * shard + 4, ROWS))
                assert shard_path(job.out_dir, shard).is_file() == all(r in seen for r in rows), (shard, seen)

    monkeypatch.setattr(extract_stage.BACKENDS, "get", lambda name: out_of_order)
    out = tmp_path / "hs"
    metrics = extract(prepared, out, rows_per_shard=4)
    assert metrics["rows_computed"] == ROWS and [p.name for p in stored_files(out)] == [
        f"shard_{s}.safetensors" for s in range(3)]


def test_an_unreadable_shard_is_removed_whatever_the_shard_size(tmp_path: Path, prepared):
    for size in (1, 4):
        out = tmp_path / f"hs-{size}"
        out.mkdir()
        shard_path(out, 7).write_bytes(b"not a shard")  # no rows of its own to name: removed, never read by train
        metrics = extract(prepared, out, rows_per_shard=size)
        assert metrics["rows_computed"] == ROWS and not shard_path(out, 7).exists()
