"""Hidden-state shards (extract.rows_per_shard > 1): the same rows as per-row files, written straight into place in
any order, resume from the unfinished folder, re-sharding, convert's row-level checks and layout from the files,
training reads, export."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eaglenest.artifacts.hidden_states.extract_params import ExtractParams
from eaglenest.artifacts.hidden_states.format import (
    CHECKSUM_FIELD,
    HIDDEN_KEY,
    METADATA_KEY,
    ROW_INDEX_KEY,
    TOKENS_KEY,
    file_checksum,
    hs_path,
    read_shard_row,
    row_digest,
    shard_path,
    shard_row_index,
    stored_files,
    with_checksum,
)
from eaglenest.artifacts.hidden_states.resume import unfinished_dir
from eaglenest.core.errors import InputFileError
from eaglenest.core.safetensors_header import tensor_extents
from eaglenest.stages.convert import convert
from eaglenest.stages.convert.params import ConvertParams
from eaglenest.stages.extract import extract_hidden_states
from eaglenest.stages.train.params import TrainParams
from tests.fixtures.fsync import record_fsyncs
from tests.fixtures.pipeline import pipeline_until_prepare

ROWS = 10


@pytest.fixture
def prepared(tmp_path: Path, tiny_verifier_dir: Path) -> tuple[Path, Path]:
    return pipeline_until_prepare(tmp_path, tiny_verifier_dir, rows=ROWS)


def extract(prepared: tuple[Path, Path], out: Path, rows_per_shard: int = 1, **params) -> dict:
    """The extract stage; row files unless ``rows_per_shard`` says otherwise (the default packs 256).

    Each row is its own batch (``batch_tokens`` 16): files of different layouts are compared byte for byte, and a
    float32 row's bits depend on the shape of the batch it was computed in, which the hf back end plans within a
    task (a shard, or a group of row files)."""
    verifier_dir, prepared_dir = prepared
    params.setdefault("batch_tokens", 16)
    return extract_hidden_states(
        ExtractParams(rows_per_shard=rows_per_shard, **params), verifier_dir, prepared_dir, out, out.parent / "m.json"
    )


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
                assert stored[key].dtype == expected[key].dtype and torch.equal(
                    stored[key].view(torch.uint8), expected[key].view(torch.uint8)
                )
    header = json.loads(safe_open(str(shard_path(shards_dir, 2)), framework="pt").metadata()["eaglenest"])
    assert header["rows_per_shard"] == 4 and header["shard"] == 2 and header["dtype"] == dtype


def test_an_interrupted_extraction_keeps_its_finished_shards(tmp_path: Path, prepared):
    fresh = tmp_path / "fresh"
    extract(prepared, fresh, rows_per_shard=4)
    out = tmp_path / "hs"
    # a run killed while it wrote shard 1: shard 0 finished in the unfinished folder, shard 1 a preallocated
    # temporary half written; the output itself empty (DVC clears it before a run)
    unfinished = unfinished_dir(out)
    unfinished.mkdir(parents=True)
    (unfinished / "shard_0.safetensors").write_bytes(shard_path(fresh, 0).read_bytes())
    (unfinished / ".shard_1.safetensors.tmp-99999").write_bytes(shard_path(fresh, 1).read_bytes()[:100])
    untouched = (unfinished / "shard_0.safetensors").stat().st_mtime_ns
    metrics = extract(prepared, out, rows_per_shard=4)
    assert metrics["rows_computed"] == 6 and metrics["rows_reused"] == 4
    assert folder(out) == folder(fresh) and not unfinished.exists()  # the same bytes as an uninterrupted run
    assert shard_path(out, 0).stat().st_mtime_ns == untouched  # kept, not written again

    # finished shards in the output (a run outside DVC), and in the unfinished folder a truncated shard 2
    shard_path(out, 1).unlink()
    unfinished.mkdir()
    (unfinished / "shard_2.safetensors").write_bytes(shard_path(out, 2).read_bytes()[:-10])
    shard_path(out, 2).unlink()
    untouched = shard_path(out, 0).stat().st_mtime_ns
    metrics = extract(prepared, out, rows_per_shard=4)
    assert metrics["rows_computed"] == 6  # shards 1 and 2
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
    return convert(
        ConvertParams(draft_vocab_size=64, **params),
        ExtractParams(rows_per_shard=rows_per_shard),
        verifier_dir,
        prepared_dir,
        hs,
        root / "vocab",
        root / "data.json",
    )


def rewrite_shard(path: Path, change) -> None:
    """The shard with ``change`` made to its tensors, checksum and all: as if its writer had put it there."""
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(path)
    change(tensors)
    rows = [
        {key: value[first : first + length] for key, value in tensors.items() if key not in (TOKENS_KEY, ROW_INDEX_KEY)}
        for _, first, length in tensors[ROW_INDEX_KEY].tolist()
    ]
    checksum = file_checksum(
        [row_digest(row) for row in rows],
        [tensors[TOKENS_KEY].numpy().tobytes(), tensors[ROW_INDEX_KEY].numpy().tobytes()],
    )
    save_file(tensors, path, metadata=with_checksum(metadata, checksum))


def zero_hidden_states(path: Path) -> None:
    """What a power loss can leave of a file renamed into place before its data reached the disk: its header, its
    length and its token ids (written first) as they were, its hidden states zeros."""
    start, extents = tensor_extents(path)
    _, _, begin, end = extents[HIDDEN_KEY]
    with open(path, "r+b") as fh:
        fh.seek(start + begin)
        fh.write(bytes(end - begin))


def without_checksum(path: Path) -> None:
    """The shard as an eaglenest without checksums wrote it: the same tensors, no checksum in its metadata."""
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    info = json.loads(metadata[METADATA_KEY])
    del info[CHECKSUM_FIELD]
    save_file(load_file(path), path, metadata={METADATA_KEY: json.dumps(info, sort_keys=True)})


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


def test_convert_reads_the_layout_from_the_files_and_refuses_a_mixed_folder_in_one_line(tmp_path: Path, prepared):
    verifier_dir, prepared_dir = prepared
    rows_dir, shards_dir, threes = tmp_path / "rows", tmp_path / "shards", tmp_path / "threes"
    extract(prepared, rows_dir)
    extract(prepared, shards_dir, rows_per_shard=4)
    extract(prepared, threes, rows_per_shard=3)
    # the layout is the files': extract.rows_per_shard (here 8) is never read by convert
    for hs in (rows_dir, shards_dir):
        metrics = convert(
            ConvertParams(draft_vocab_size=64),
            ExtractParams(rows_per_shard=8),
            verifier_dir,
            prepared_dir,
            hs,
            tmp_path / "vocab",
            tmp_path / "data.json",
        )
        assert metrics["samples"] == ROWS and metrics["excluded"] == 0
    mixed, sizes = tmp_path / "mixed", tmp_path / "sizes"
    for folder_, extra in ((mixed, hs_path(rows_dir, 9)), (sizes, shard_path(threes, 3))):
        folder_.mkdir()
        for path in stored_files(shards_dir):
            (folder_ / path.name).write_bytes(path.read_bytes())
        (folder_ / extra.name).write_bytes(extra.read_bytes())
    for hs, message in [
        (
            mixed,
            r"mixed: holds 1 row files \(hs_\{i\}.safetensors\) and 3 shards \(shard_\{s\}.safetensors\), two "
            r"layouts in one folder; run `dvc repro extract` \(it writes the folder anew\)$",
        ),
        (
            sizes,
            r"sizes: shards of different sizes \(shard_3.safetensors: 3 rows, shard_0.safetensors: 4 rows\); run "
            r"`dvc repro extract`",
        ),
    ]:
        with pytest.raises(InputFileError, match=message) as err:
            convert(
                ConvertParams(draft_vocab_size=64, on_bad="skip"),
                ExtractParams(rows_per_shard=4),
                verifier_dir,
                prepared_dir,
                hs,
                tmp_path / "vocab2",
                tmp_path / "data2.json",
            )
        assert "\n" not in str(err.value) and not (tmp_path / "vocab2").exists()
    # the fix the line gives: extract writes the folder of its layout, without recomputing a row, and convert passes
    assert extract(prepared, sizes, rows_per_shard=4)["rows_computed"] == 0
    convert(
        ConvertParams(draft_vocab_size=64),
        ExtractParams(rows_per_shard=4),
        verifier_dir,
        prepared_dir,
        sizes,
        tmp_path / "vocab2",
        tmp_path / "data2.json",
    )
    assert folder(sizes) == folder(shards_dir)


@pytest.mark.parametrize(
    ("change", "message"),
    [("index", "its row index disagrees with its tensors at row 5"), ("truncated", "(truncated?)")],
)
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
        data = load_training_data(
            TrainParams(), verifier, prepared_dir, out, tmp_path / f"c-{size}" / "vocab", torch.float32
        )
        items[size] = [data.dataset[row] for row in range(ROWS)]
    for from_rows, from_shards in zip(items[1], items[4], strict=True):
        assert from_rows.keys() == from_shards.keys()
        for key, value in from_rows.items():
            assert torch.equal(value, from_shards[key]), key


def test_export_writes_speculators_layout_equal_to_row_files(tmp_path: Path, prepared, capsys):
    from datasets import load_from_disk
    from hs_connectors import FileTransfer
    from speculators.data_generation.offline import check_hidden_states

    from eaglenest.commands.cli import main as cli_main
    from eaglenest.commands.inspect import inspect_path

    rows_dir, shards_dir, out = tmp_path / "rows", tmp_path / "shards", tmp_path / "export"
    extract(prepared, rows_dir)
    extract(prepared, shards_dir, rows_per_shard=4)
    export = ["export", "--format", "speculators", "--prepared", str(prepared[1]), "--hidden-states", str(shards_dir)]
    status = cli_main([*export, "--out", str(out)])
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

    # A rerun replaces its own export; an --out that holds the inputs is refused, and they are kept.
    assert cli_main([*export, "--out", str(out)]) == 0
    inputs = folder(prepared[1]), folder(shards_dir)
    assert cli_main([*export, "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path} contains --prepared" in capsys.readouterr().err
    assert (folder(prepared[1]), folder(shards_dir)) == inputs


def test_rows_finishing_out_of_order_go_straight_to_their_place(
    tmp_path: Path, prepared, monkeypatch: pytest.MonkeyPatch
):
    """As vLLM's requests finish: each row is written at its offset when it arrives, and the shard appears under its
    name only once its last row is in; the bytes are those of rows written in order."""
    from eaglenest.artifacts.hidden_states import engines
    from eaglenest.artifacts.hidden_states.engines.hf import HfEngine

    in_order = tmp_path / "in-order"
    extract(prepared, in_order, rows_per_shard=4)
    out = tmp_path / "hs"
    seen: list[int] = []

    class OutOfOrder(HfEngine):
        def compute(self, rows, input_ids, write) -> None:
            computed = {}
            super().compute(rows, input_ids, lambda row, hidden: computed.__setitem__(row, hidden.clone()))
            order = list(computed)
            random.Random(1).shuffle(order)
            for row in order:
                write(row, computed[row])
                seen.append(row)
                shard = row // 4
                # the task (this shard) is not finished yet: no file under its name, only the preallocated temporary
                assert not (unfinished_dir(out) / shard_path(Path(), shard).name).exists()

    monkeypatch.setitem(engines.BACKENDS._items, "hf", OutOfOrder)
    metrics = extract(prepared, out, rows_per_shard=4)
    assert metrics["rows_computed"] == ROWS and sorted(seen) == list(range(ROWS)) and seen != sorted(seen)
    assert folder(out) == folder(in_order)


def test_an_unreadable_shard_is_removed_whatever_the_shard_size(tmp_path: Path, prepared):
    for size in (1, 4):
        out = tmp_path / f"hs-{size}"
        out.mkdir()
        shard_path(out, 7).write_bytes(b"not a shard")  # no rows of its own to name: removed, never read by train
        metrics = extract(prepared, out, rows_per_shard=size)
        assert metrics["rows_computed"] == ROWS and not shard_path(out, 7).exists()


@pytest.mark.parametrize("damage", ["zeroed", "no checksum"])
def test_a_shard_whose_data_is_lost_or_unchecked_is_recomputed_on_resume(
    tmp_path: Path, prepared, damage: str, caplog: pytest.LogCaptureFixture
):
    """A shard renamed into place just before a power loss keeps its header, its size and its token ids, and holds
    zeros: resume recomputes it, as it does a shard an older eaglenest wrote without a checksum; the rest is kept."""
    fresh = tmp_path / "fresh"
    extract(prepared, fresh, rows_per_shard=4)
    out = tmp_path / "hs"
    unfinished = unfinished_dir(out)
    unfinished.mkdir(parents=True)
    for shard in range(3):
        (unfinished / shard_path(Path(), shard).name).write_bytes(shard_path(fresh, shard).read_bytes())
    (zero_hidden_states if damage == "zeroed" else without_checksum)(unfinished / "shard_1.safetensors")
    with caplog.at_level("INFO"):
        metrics = extract(prepared, out, rows_per_shard=4)
    assert metrics["rows_computed"] == 4 and metrics["rows_reused"] == ROWS - 4
    assert folder(out) == folder(fresh)  # bit-identical to an uninterrupted run
    reason = "its data does not match its checksum" if damage == "zeroed" else "its header holds no checksum"
    assert [record.getMessage() for record in caplog.records if "recomputing" in record.getMessage()] == [
        f"recomputing shard_1.safetensors: {reason}"
        + (
            " (written over, or lost to a crash before it reached the disk)"
            if damage == "zeroed"
            else " (written by an older eaglenest)"
        )
    ]


@pytest.mark.parametrize("damage", ["zeroed", "no checksum"])
def test_convert_refuses_a_shard_whose_data_is_lost_or_unchecked_naming_it(tmp_path: Path, prepared, damage: str):
    out = tmp_path / "hs"
    extract(prepared, out, rows_per_shard=4)
    (zero_hidden_states if damage == "zeroed" else without_checksum)(shard_path(out, 1))
    with pytest.raises(InputFileError) as err:
        run_convert(prepared, out, tmp_path)
    reason = "its data does not match its checksum" if damage == "zeroed" else "its header holds no checksum"
    assert f"4 of {ROWS} rows' hidden states are bad" in str(err.value)
    assert f"{shard_path(out, 1)} row 4: {reason}" in str(err.value)
    metrics = run_convert(prepared, out, tmp_path, on_bad="skip")
    assert metrics["excluded_rows"] == [4, 5, 6, 7]


def test_every_shard_is_fsynced_before_its_rename(tmp_path: Path, prepared, monkeypatch: pytest.MonkeyPatch):
    """A shard renamed into place before its data reached the disk comes back from a power loss as zeros."""
    synced = record_fsyncs(monkeypatch)
    extract(prepared, tmp_path / "hs", rows_per_shard=4)
    for shard in range(3):
        assert any(name.startswith(f".shard_{shard}.safetensors.tmp-") for name in synced), synced
