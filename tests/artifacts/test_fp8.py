"""fp8 hidden states (extract.dtype: float8_e4m3fn): speculators' hs_connectors layout both ways, convert and
train on them, and the one-line refusals of a broken fp8 file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglenest.artifacts.hidden_states.extract_params import ExtractParams
from eaglenest.artifacts.hidden_states.format import HIDDEN_KEY, SCALES_KEY, TOKENS_KEY, decode_hidden_states, hs_path
from eaglenest.commands.importer import import_dump
from eaglenest.commands.inspect import inspect_path
from eaglenest.core.errors import InputFileError
from eaglenest.stages.convert import convert
from eaglenest.stages.convert.params import ConvertParams
from eaglenest.stages.extract import extract_hidden_states
from eaglenest.stages.train import TrainPaths, train_draft
from eaglenest.stages.train.params import TrainParams
from tests.fixtures.pipeline import pipeline_until_prepare, stored_row

FP8 = "float8_e4m3fn"
ROWS = 12


@pytest.fixture(scope="module")
def extracted(tmp_path_factory: pytest.TempPathFactory, tiny_verifier_dir: Path) -> dict[str, Path]:
    """The same rows extracted in float32 (the reference) and in fp8."""
    root = tmp_path_factory.mktemp("fp8")
    verifier_dir, prepared = pipeline_until_prepare(root, tiny_verifier_dir, rows=ROWS)
    for dtype in ("float32", FP8):
        extract_hidden_states(
            ExtractParams(dtype=dtype, rows_per_shard=1),
            verifier_dir,
            prepared,
            root / dtype,
            root / f"extract-{dtype}.json",
        )
    return {"root": root, "verifier": verifier_dir, "prepared": prepared, "fp32": root / "float32", "fp8": root / FP8}


def test_fp8_files_hold_speculators_layout_and_dequantize_close_to_float32(extracted: dict[str, Path]):
    for row in range(ROWS):
        stored = load_file(hs_path(extracted["fp8"], row))
        reference = load_file(hs_path(extracted["fp32"], row))[HIDDEN_KEY]  # [seq, slots, hidden]
        seq = reference.shape[0]
        assert stored[HIDDEN_KEY].dtype == torch.float8_e4m3fn and stored[HIDDEN_KEY].shape == reference.shape
        assert stored[SCALES_KEY].dtype == torch.float32 and list(stored[SCALES_KEY].shape) == [seq, 1, 1]
        assert torch.equal(stored[TOKENS_KEY], load_file(hs_path(extracted["fp32"], row))[TOKENS_KEY])
        # e4m3 keeps 3 mantissa bits: each value within 1/16 of itself, or of the token's scale near zero
        error = (decode_hidden_states(stored) - reference).abs()
        bound = reference.abs() / 16 + stored[SCALES_KEY]
        assert bool((error <= bound).all()), float((error - bound).max())
        assert not torch.equal(decode_hidden_states(stored), reference)  # it really is quantized


def test_fp8_takes_about_half_the_disk_of_bf16(extracted: dict[str, Path]):
    fp8 = json.loads((extracted["root"] / f"extract-{FP8}.json").read_text())
    fp32 = json.loads((extracted["root"] / "extract-float32.json").read_text())
    # per token: slots x hidden values (1 byte against 4) plus one 4-byte scale and the 8-byte token id
    assert fp8["bytes_per_token"] < 0.32 * fp32["bytes_per_token"]


def test_speculators_fp8_transfer_reads_eaglenest_files(extracted: dict[str, Path]):
    from hs_connectors import FP8Transfer

    transfer = FP8Transfer(extracted["fp8"], dequantize_dtype=torch.float32)
    for row in (0, ROWS - 1):
        sample = transfer.get_cached(row)
        assert SCALES_KEY not in sample
        assert torch.equal(sample[HIDDEN_KEY], decode_hidden_states(load_file(hs_path(extracted["fp8"], row))))


def test_files_from_speculators_fp8_connector_are_imported_as_they_are(extracted: dict[str, Path], tmp_path: Path):
    """A folder written as hs_connectors' FP8HiddenStatesConnector writes (its quantizer, its keys) is read by
    `extract.backend: import` (converted to extract.dtype) and by `eaglenest import` (kept in fp8)."""
    from hs_connectors.fp8_utils import quantize_tensor_to_fp8

    theirs = tmp_path / "theirs" / "hidden_states"
    theirs.mkdir(parents=True)
    for row in range(ROWS):
        data = load_file(hs_path(extracted["fp32"], row))
        quantized, scales = quantize_tensor_to_fp8(data[HIDDEN_KEY])
        save_file({HIDDEN_KEY: quantized, SCALES_KEY: scales, TOKENS_KEY: data[TOKENS_KEY]}, hs_path(theirs, row))
    out = tmp_path / "hs"
    extract_hidden_states(
        ExtractParams(backend="import", import_path=str(theirs), dtype=FP8),
        extracted["verifier"],
        extracted["prepared"],
        out,
        tmp_path / "extract.json",
    )
    for row in range(ROWS):  # same quantizer, same values: the bytes of the tensors are theirs (in a shard)
        ours, source = stored_row(out, row), load_file(hs_path(theirs, row))
        assert torch.equal(ours[HIDDEN_KEY].view(torch.uint8), source[HIDDEN_KEY].view(torch.uint8))
        assert torch.equal(ours[SCALES_KEY], source[SCALES_KEY])

    shutil.copytree(extracted["prepared"], tmp_path / "theirs", dirs_exist_ok=True)
    import_dump("speculators", tmp_path / "theirs", tmp_path / "imported")
    imported = load_file(hs_path(tmp_path / "imported" / "hidden_states", 3))
    assert imported[HIDDEN_KEY].dtype == torch.float8_e4m3fn and SCALES_KEY in imported


def test_convert_train_and_inspect_run_on_fp8(extracted: dict[str, Path], tmp_path: Path):
    metrics = convert(
        ConvertParams(draft_vocab_size=64),
        ExtractParams(dtype=FP8, rows_per_shard=1),
        extracted["verifier"],
        extracted["prepared"],
        extracted["fp8"],
        tmp_path / "vocab",
        tmp_path / "data.json",
    )
    assert metrics["excluded"] == 0
    result = train_draft(
        TrainParams(steps=4, eval_every=4, total_seq_len=256, lr=3e-3, warmup_steps=1),
        TrainPaths(
            verifier=extracted["verifier"],
            prepared=extracted["prepared"],
            hidden_states=extracted["fp8"],
            vocab=tmp_path / "vocab",
            out=tmp_path / "draft",
            metrics=tmp_path / "train.json",
            details=tmp_path / "train_details.json",
            live_dir=tmp_path / "live",
            checkpoints=tmp_path / "ck",
        ),
    )
    assert result["steps"] == 4 and (tmp_path / "draft" / "model.safetensors").is_file()
    assert all(torch.isfinite(torch.tensor(result["val_acc"])))
    described = "\n".join(inspect_path(hs_path(extracted["fp8"], 0)))
    assert "hidden_states: float8_e4m3fn" in described and "(dequantized with hidden_states_scales)" in described


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("no scales", "fp8 hidden_states without hidden_states_scales (the per-token scales): cannot be dequantized"),
        ("scales shape", "hidden_states_scales is F32 [SEQ], expected F32 [SEQ, 1, 1]"),
        ("scales dtype", "hidden_states_scales is BF16 [SEQ, 1, 1], expected F32 [SEQ, 1, 1]"),
    ],
)
def test_a_broken_fp8_file_is_named_with_its_problem(
    extracted: dict[str, Path], tmp_path: Path, how: str, message: str
):
    hs = tmp_path / "hs"
    shutil.copytree(extracted["fp8"], hs)
    path = hs_path(hs, 4)
    data = load_file(path)
    seq = data[TOKENS_KEY].shape[0]
    if how == "no scales":
        del data[SCALES_KEY]
    elif how == "scales shape":
        data[SCALES_KEY] = data[SCALES_KEY].flatten().contiguous()
    else:
        data[SCALES_KEY] = data[SCALES_KEY].bfloat16()
    save_file(data, path)
    with pytest.raises(InputFileError) as err:
        convert(
            ConvertParams(draft_vocab_size=64),
            ExtractParams(dtype=FP8, rows_per_shard=1),
            extracted["verifier"],
            extracted["prepared"],
            hs,
            tmp_path / "vocab",
            tmp_path / "data.json",
        )
    assert message.replace("SEQ", str(seq)) in str(err.value) and "hs_4.safetensors" in str(err.value)
    assert not (tmp_path / "vocab").exists()
