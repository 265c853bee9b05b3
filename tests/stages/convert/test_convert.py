"""convert: each bad hidden-state file named with its problem; the draft vocabulary; import and inspect."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglenest.artifacts.hidden_states.extract_params import ExtractParams
from eaglenest.artifacts.hidden_states.format import hs_path
from eaglenest.artifacts.vocab import load_vocab
from eaglenest.commands.cli import main as cli_main
from eaglenest.commands.importer import import_dump
from eaglenest.commands.inspect import inspect_path
from eaglenest.core.errors import EaglenestError, InputFileError
from eaglenest.core.safetensors_header import tensor_extents
from eaglenest.stages.convert import convert
from eaglenest.stages.convert.params import ConvertParams
from eaglenest.stages.extract import extract_hidden_states
from eaglenest.stages.prepare import prepare_dataset
from eaglenest.stages.prepare.params import PrepareParams
from tests.fixtures.pipeline import pipeline_until_prepare, stored_row


@pytest.fixture
def extracted(tmp_path: Path, tiny_verifier_dir: Path) -> dict[str, Path]:
    verifier_dir, prepared = pipeline_until_prepare(tmp_path, tiny_verifier_dir, rows=10)
    hs = tmp_path / "data" / "hidden_states"
    # Row files: each test below breaks one file of one row.
    extract_hidden_states(
        ExtractParams(rows_per_shard=1), verifier_dir, prepared, hs, tmp_path / "metrics" / "extract.json"
    )
    return {"verifier": verifier_dir, "prepared": prepared, "hs": hs, "root": tmp_path}


def run_convert(paths: dict[str, Path], **params) -> dict:
    params.setdefault("draft_vocab_size", 64)  # the default 8192 exceeds the tiny verifier's 300 tokens
    return convert(
        ConvertParams(**params),
        ExtractParams(dtype="bfloat16", rows_per_shard=1),
        paths["verifier"],
        paths["prepared"],
        paths["hs"],
        paths["root"] / "data" / "vocab",
        paths["root"] / "metrics" / "data.json",
    )


def corrupt(path: Path, how: str) -> None:
    data = load_file(path)
    if how == "missing key":
        save_file({"hidden_states": data["hidden_states"]}, path)
    elif how == "wrong shape":
        save_file({"hidden_states": data["hidden_states"][:, :3].contiguous(), "token_ids": data["token_ids"]}, path)
    elif how == "wrong hidden size":
        save_file(
            {"hidden_states": data["hidden_states"][:, :, :16].contiguous(), "token_ids": data["token_ids"]}, path
        )
    elif how == "nan":
        data["hidden_states"][1, 2, 3] = float("nan")
        save_file(data, path)
    elif how == "token mismatch":
        data["token_ids"][2] += 1
        save_file(data, path)
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[:-10])
    elif how == "missing file":
        path.unlink()
    elif how == "wrong dtype":
        save_file({"hidden_states": data["hidden_states"].float(), "token_ids": data["token_ids"]}, path)
    elif how == "zeroed":  # renamed into place before its data reached the disk: a power loss leaves zeros
        start, extents = tensor_extents(path)
        _, _, begin, end = extents["hidden_states"]
        with open(path, "r+b") as fh:
            fh.seek(start + begin)
            fh.write(bytes(end - begin))


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("missing key", r"hs_3.safetensors: missing key\(s\) \['token_ids'\]"),
        ("wrong shape", r"hs_3.safetensors: hidden_states shape \[\d+, 3, 32\], expected \[\d+, 4, 32\]"),
        ("wrong hidden size", r"hs_3.safetensors: hidden_states shape \[\d+, 4, 16\], expected \[\d+, 4, 32\]"),
        ("nan", r"hs_3.safetensors: 1 non-finite values \(first at token 1, slot 2\)"),
        ("token mismatch", r"hs_3.safetensors: token_ids differ from the prepared input_ids \(first at position 2\)"),
        ("truncated", r"hs_3.safetensors: \d+ bytes on disk, header promises \d+ \(truncated\?\)"),
        ("missing file", r"hs_3.safetensors: missing"),
        ("wrong dtype", r"hs_3.safetensors: hidden_states dtype F32, expected BF16 \(bfloat16\)"),
        ("zeroed", r"hs_3.safetensors: its data does not match its checksum \(written over, or lost to a crash"),
    ],
)
def test_each_bad_file_gets_its_own_message(extracted: dict[str, Path], how: str, message: str):
    corrupt(hs_path(extracted["hs"], 3), how)
    with pytest.raises(InputFileError, match=r"1 of 10 hidden-state files are bad") as info:
        run_convert(extracted)
    assert len(__import__("re").findall(message, str(info.value))) == 1, str(info.value)
    assert "convert.on_bad: skip" in str(info.value)
    assert not (extracted["root"] / "data" / "vocab").exists()  # nothing half-written downstream


def test_skip_excludes_and_records_the_rows(extracted: dict[str, Path]):
    corrupt(hs_path(extracted["hs"], 1), "nan")
    corrupt(hs_path(extracted["hs"], 4), "missing file")
    metrics = run_convert(extracted, on_bad="skip")
    assert metrics["excluded"] == 2 and metrics["excluded_rows"] == [1, 4]
    assert metrics["samples"] == 8
    rows = json.loads((extracted["root"] / "data/vocab/rows.json").read_text())
    assert 1 not in rows["train"] + rows["val"] and rows["excluded"] == [1, 4]
    assert "non-finite" in rows["problems"]["1"]


def test_vocab_mapping_round_trips_and_speculators_loads_it(extracted: dict[str, Path]):
    from datasets import load_from_disk
    from speculators.train.cli import _load_mappings  # speculators' own loader for these files

    metrics = run_convert(extracted, draft_vocab_size=64)
    vocab_dir = extracted["root"] / "data" / "vocab"
    d2t, t2d, size = _load_mappings(vocab_dir / "d2t-64.npy", vocab_dir / "t2d-64.npy", 64)
    assert size == 64 and d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.shape == (300,)
    targets = torch.arange(64) + d2t  # target = i + d2t[i]
    assert torch.equal(torch.nonzero(t2d).flatten(), targets)
    record, d2t_ours, t2d_ours = load_vocab(vocab_dir)
    assert torch.equal(d2t_ours, d2t) and torch.equal(t2d_ours, t2d)
    # Every loss-masked train token is in the vocabulary: 64 > the tiny data's distinct tokens.
    data = load_from_disk(str(extracted["prepared"])).with_format(None)
    train_tokens = {
        t for row in data.select(range(8)) for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m
    }
    assert train_tokens <= set(targets.tolist())
    assert len(train_tokens) < 64  # so the rest was filled deterministically
    assert metrics["vocab_coverage_train"] == 1.0
    assert record["distinct_train_tokens"] == len(train_tokens)
    freq = torch.load(vocab_dir / "token_freq.pt", weights_only=True)
    assert set(freq) == train_tokens


def test_small_vocab_coverage_below_one_and_full_vocab(extracted: dict[str, Path]):
    small = run_convert(extracted, draft_vocab_size=3)
    assert 0 < small["vocab_coverage_train"] < 1
    full = run_convert(extracted, draft_vocab_size=None)
    assert full["vocab_coverage_train"] == full["vocab_coverage_val"] == 1.0
    assert full["draft_vocab_size"] == 300
    assert not list((extracted["root"] / "data/vocab").glob("d2t-*.npy"))


def test_draft_vocab_larger_than_the_verifier_is_refused(extracted: dict[str, Path]):
    with pytest.raises(
        EaglenestError,
        match=r"convert.draft_vocab_size = 400 exceeds the verifier's vocabulary "
        r"of 300; use null",
    ):
        run_convert(extracted, draft_vocab_size=400)


def write_pt_dump(folder: Path, samples: int, layers: int = 4, hidden: int = 32, base_len: int = 5) -> None:
    folder.mkdir(parents=True)
    for i in range(samples):
        seq = base_len + i
        torch.save(
            {
                "input_ids": torch.arange(seq, dtype=torch.int64) + 3,
                "hidden_states": [torch.randn(seq, hidden, dtype=torch.bfloat16) for _ in range(layers)],
                "loss_mask": torch.tensor([0, 0] + [1] * (seq - 2)),
            },
            folder / f"data_{i}.pt",
        )


class Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_pt_with_pickled_object_is_refused(tmp_path: Path):
    write_pt_dump(tmp_path / "dump", 2)
    torch.save(
        {"input_ids": torch.arange(3), "hidden_states": [Evil()], "loss_mask": torch.ones(3)},
        tmp_path / "dump" / "data_1.pt",
    )
    with pytest.raises(
        InputFileError,
        match=r"data_1.pt: refused: holds pickled objects that "
        r"torch.load\(weights_only=True\) will not load",
    ):
        import_dump("speculators-pt", tmp_path / "dump", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_import_formats_feed_the_pipeline(tmp_path: Path, tiny_verifier_dir: Path):
    """speculators-pt -> eaglenest layout -> speculators layout again; both run prepare/extract/convert."""
    from eaglenest.stages.verifier import build_verifier
    from eaglenest.stages.verifier.params import VerifierParams

    write_pt_dump(tmp_path / "dump", 6)
    counts = import_dump("speculators-pt", tmp_path / "dump", tmp_path / "imported")
    assert counts == {"samples": 6, "layers": 4, "hidden_size": 32}
    again = import_dump("speculators", tmp_path / "imported", tmp_path / "reimported")
    assert again == counts
    verifier_dir = tmp_path / "verifier"
    build_verifier(VerifierParams(model=str(tiny_verifier_dir), aux_layers=[1, 3, 5]), verifier_dir)
    for name in ("imported", "reimported"):
        root = tmp_path / f"run-{name}"
        prepared, hs = root / "prepared", root / "hidden_states"
        prepare_dataset(
            PrepareParams(source=[f"import:{tmp_path / name}"], val_fraction=0.2),
            None,
            prepared,
            root / "prepare.json",
            set(),
        )
        extract_hidden_states(
            ExtractParams(backend="import", import_path=str(tmp_path / name / "hidden_states")),
            verifier_dir,
            prepared,
            hs,
            root / "extract.json",
        )
        metrics = convert(
            ConvertParams(draft_vocab_size=16),
            ExtractParams(dtype="bfloat16"),
            verifier_dir,
            prepared,
            hs,
            root / "vocab",
            root / "data.json",
        )
        assert metrics["samples"] == 6 and metrics["excluded"] == 0
        original = torch.load(tmp_path / "dump" / "data_2.pt", weights_only=True)
        stored = stored_row(hs, 2)  # the per-row dump lands in a shard (extract.rows_per_shard)
        assert torch.equal(stored["hidden_states"], torch.stack(original["hidden_states"], dim=1))


def test_import_rows_are_never_truncated(tmp_path: Path):
    write_pt_dump(tmp_path / "dump", 3, base_len=15)
    import_dump("speculators-pt", tmp_path / "dump", tmp_path / "imported")
    with pytest.raises(
        InputFileError,
        match=r"imported: row 2 has 17 tokens > prepare.max_len = 16; imported rows "
        r"are never truncated",
    ):
        prepare_dataset(
            PrepareParams(source=[f"import:{tmp_path / 'imported'}"], max_len=16),
            None,
            tmp_path / "p",
            tmp_path / "m.json",
            set(),
        )


def test_inspect_describes_files_folders_and_datasets(extracted: dict[str, Path], tmp_path: Path, capsys):
    lines = inspect_path(hs_path(extracted["hs"], 0))
    text = "\n".join(lines)
    assert "hidden_states: bfloat16 [" in text and "slot 3:" in text and "token_ids: int64" in text
    folder = "\n".join(inspect_path(extracted["hs"]))
    assert "summary of 10 safetensors files" in folder and "BF16 [seq, 4, 32]: 10 files" in folder
    dataset = "\n".join(inspect_path(extracted["prepared"]))
    assert "10 rows" in dataset and "loss tokens" in dataset
    write_pt_dump(tmp_path / "dump", 1)
    pt = "\n".join(inspect_path(tmp_path / "dump" / "data_0.pt"))
    assert "hidden_states: list of 4" in pt and "bfloat16 [5, 32]" in pt
    assert cli_main(["inspect", str(extracted["verifier"].parent.parent / "data" / "hidden_states")]) == 0
    assert "safetensors files" in capsys.readouterr().out
    assert cli_main(["inspect", str(tmp_path / "nope")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
