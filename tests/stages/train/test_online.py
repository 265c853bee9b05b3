"""extract.store: online: nothing stored, the train stage computes hidden states per batch, and trains the draft
stored files would have trained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import eaglenest.stages.train.online as online_module
from eaglenest.artifacts.hidden_states.extract_params import ExtractParams
from eaglenest.artifacts.hidden_states.format import shard_path
from eaglenest.artifacts.hidden_states.online import MANIFEST_FILE
from eaglenest.artifacts.prepared import write_prepared
from eaglenest.artifacts.verifier import load_verifier_info
from eaglenest.commands.inspect import inspect_path
from eaglenest.commands.params_file import parse_params
from eaglenest.core.errors import EaglenestError, InputFileError, ParamsError
from eaglenest.core.params import ClusterParams
from eaglenest.stages.convert import convert
from eaglenest.stages.convert.params import ConvertParams
from eaglenest.stages.extract import extract_hidden_states
from eaglenest.stages.train import TrainPaths, train_draft
from eaglenest.stages.train.data import load_training_data
from eaglenest.stages.train.online import OnlineTransfer
from eaglenest.stages.train.params import TrainParams
from tests.fixtures.pipeline import pipeline_until_prepare

ROWS = 24
# float32: the online and stored runs are compared to 1e-4, closer than bf16 arithmetic rounds.
FAST = {
    "total_seq_len": 256,
    "lr": 3e-3,
    "warmup_steps": 2,
    "steps": 8,
    "eval_every": 4,
    "checkpoint_every": 4,
    "precision": "float32",
}


def extract_and_convert(root: Path, store: str, dtype: str = "bfloat16", **extract: object) -> dict[str, Path]:
    """extract (files or manifest) and convert into ``root/<store>-<dtype>/``, from ``root``'s prepared rows."""
    out = root / f"{store}-{dtype}"
    verifier, prepared = root / "models" / "verifier", root / "data" / "prepared"
    params = ExtractParams(store=store, dtype=dtype, **extract)
    extract_hidden_states(params, verifier, prepared, out / "hs", out / "extract.json")
    convert(
        ConvertParams(draft_vocab_size=64), params, verifier, prepared, out / "hs", out / "vocab", out / "data.json"
    )
    return {"verifier": verifier, "prepared": prepared, "hs": out / "hs", "vocab": out / "vocab", "out": out}


def train_in(paths: dict[str, Path], name: str, cluster: ClusterParams | None = None, **params: object) -> dict:
    """The draft trained on ``paths`` into ``paths["out"]/name`` (a stream's engines on ``cluster``)."""
    out = paths["out"] / name
    inputs = TrainPaths(
        verifier=paths["verifier"],
        prepared=paths["prepared"],
        hidden_states=paths["hs"],
        vocab=paths["vocab"],
        out=out / "draft",
        metrics=out / "train.json",
        details=out / "train_details.json",
        live_dir=out / "dvclive",
        checkpoints=out / "checkpoints",
    )
    return train_draft(TrainParams(**{**FAST, **params}), inputs, cluster)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory, tiny_verifier_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("online")
    pipeline_until_prepare(root, tiny_verifier_dir, rows=ROWS)
    return root


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_online_training_gives_the_draft_stored_files_give(prepared: Path, dtype: str):
    stored = extract_and_convert(prepared, "files", dtype)
    online = extract_and_convert(prepared, "online", dtype)
    # The online folder holds the manifest alone; the vocabulary is the same.
    assert [p.name for p in online["hs"].iterdir()] == [MANIFEST_FILE]
    assert (online["vocab"] / "rows.json").read_text() == (stored["vocab"] / "rows.json").read_text()
    assert json.loads((online["out"] / "data.json").read_text())["bytes"] == 0

    a = train_in(stored, "draft")
    b = train_in(online, "draft")
    assert (a["hidden_states"], b["hidden_states"]) == ("files", "online")
    # Rounded to the same storage dtype, only the verifier's batching differs (rounding error in fp32): the
    # losses agree to 1e-4 and every weight of the two drafts to 1e-4 of its scale.
    assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-4)
    assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)
    wa = load_file(stored["out"] / "draft" / "draft" / "model.safetensors")
    wb = load_file(online["out"] / "draft" / "draft" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for name in wa:
        if not wa[name].is_floating_point():  # the vocabulary maps
            assert torch.equal(wa[name], wb[name]), name
            continue
        scale = max(float(wa[name].abs().max()), 1e-6)
        assert float((wa[name] - wb[name]).abs().max()) <= 1e-4 * scale, name


def test_online_rows_equal_the_stored_files(prepared: Path):
    """Row by row: what the train stage computes equals what the extract stage stores (bf16 both)."""
    stored = extract_and_convert(prepared, "files")
    online = extract_and_convert(prepared, "online")
    verifier, model_dir = load_verifier_info(stored["verifier"])
    params = TrainParams(total_seq_len=256)
    files = load_training_data(params, verifier, stored["prepared"], stored["hs"], stored["vocab"], torch.float32)
    computed = load_training_data(
        params,
        verifier,
        online["prepared"],
        online["hs"],
        online["vocab"],
        torch.float32,
        model_dir=model_dir,
        device=torch.device("cpu"),
    )
    assert isinstance(computed.online, OnlineTransfer) and files.online is None
    computed.online.compute(list(range(ROWS)))  # one forward over every row, padded to the longest
    differing = 0
    for row in range(ROWS):
        a, b = files.dataset[row], computed.dataset[row]
        assert torch.equal(a["input_ids"], b["input_ids"])
        for key in ("hidden_states", "verifier_last_hidden_states"):
            # bf16 values: equal, or one bf16 step apart where fp32 rounding in another batch crossed a boundary
            close = torch.isclose(a[key], b[key], rtol=2**-7, atol=1e-6)
            assert bool(close.all()), (row, key)
            differing += int((a[key] != b[key]).sum())
    total = sum(files.dataset[row]["hidden_states"].numel() * 4 // 3 for row in range(ROWS))
    assert differing <= total * 0.01, (differing, total)


def test_online_manifest_switches_back_and_forth(prepared: Path):
    verifier, prepared_dir = prepared / "models" / "verifier", prepared / "data" / "prepared"
    hs = prepared / "switch"
    extract_hidden_states(ExtractParams(), verifier, prepared_dir, hs, prepared / "e1.json")
    assert shard_path(hs, 0).is_file()
    metrics = extract_hidden_states(ExtractParams(store="online"), verifier, prepared_dir, hs, prepared / "e2.json")
    assert sorted(p.name for p in hs.iterdir()) == [MANIFEST_FILE]  # the stored files are gone
    assert metrics["store"] == "online" and metrics["rows"] == ROWS and metrics["rows_computed"] == 0
    manifest = json.loads((hs / MANIFEST_FILE).read_text())
    assert manifest["layer_ids"] == [1, 3, 5, 8] and manifest["dtype"] == "bfloat16"
    described = "\n".join(inspect_path(hs))
    assert f"online extraction (nothing stored; the train stage computes them): {ROWS} rows" in described
    # Deterministic: the same rows and verifier give the same bytes, so DVC sees no change.
    before = (hs / MANIFEST_FILE).read_bytes()
    extract_hidden_states(ExtractParams(store="online"), verifier, prepared_dir, hs, prepared / "e3.json")
    assert (hs / MANIFEST_FILE).read_bytes() == before
    # convert with store: files refuses the manifest; back to files, the manifest goes and the files return.
    with pytest.raises(InputFileError, match="an extraction that stored nothing, but extract.store is files"):
        convert(
            ConvertParams(draft_vocab_size=64),
            ExtractParams(dtype="bfloat16"),
            verifier,
            prepared_dir,
            hs,
            prepared / "v",
            prepared / "d.json",
        )
    extract_hidden_states(ExtractParams(), verifier, prepared_dir, hs, prepared / "e4.json")
    assert not (hs / MANIFEST_FILE).exists() and shard_path(hs, 0).is_file()


def test_a_manifest_for_other_rows_is_refused(prepared: Path, tmp_path: Path):
    verifier, prepared_dir = prepared / "models" / "verifier", prepared / "data" / "prepared"
    hs = tmp_path / "hs"
    extract_hidden_states(ExtractParams(store="online"), verifier, prepared_dir, hs, tmp_path / "extract.json")
    other = tmp_path / "other-prepared"
    write_prepared(other, [[5, 6, 7, 8]] * 4, [[0, 0, 1, 1]] * 4, train_rows=3, val_prompts=[])
    with pytest.raises(InputFileError, match=r"manifest.json: its rows, rows_sha256 differ .*dvc repro extract"):
        convert(
            ConvertParams(draft_vocab_size=64),
            ExtractParams(store="online"),
            verifier,
            other,
            hs,
            tmp_path / "vocab",
            tmp_path / "d.json",
        )
    empty = tmp_path / "no-manifest"
    empty.mkdir()
    with pytest.raises(InputFileError, match="manifest.json: missing, but extract.store keeps no hidden states"):
        convert(
            ConvertParams(draft_vocab_size=64),
            ExtractParams(store="online"),
            verifier,
            prepared_dir,
            empty,
            tmp_path / "vocab",
            tmp_path / "d.json",
        )


def test_a_verifier_that_does_not_fit_is_one_line(prepared: Path, monkeypatch: pytest.MonkeyPatch):
    paths = extract_and_convert(prepared, "online")
    monkeypatch.setattr(online_module, "available_memory", lambda device: 1024)
    with pytest.raises(
        EaglenestError,
        match=r"extract.store: online keeps the verifier .* GiB of weights as loaded "
        r"on cpu.* use extract.store: files",
    ):
        train_in(paths, "too-big")
    assert not (paths["out"] / "too-big" / "draft").exists()


def test_online_params_refuse_what_cannot_work():
    with pytest.raises(ParamsError) as err:
        parse_params({"extract": {"store": "online", "backend": "vllm"}})
    message = str(err.value)
    assert "extract.backend: vllm cannot (set extract.backend: hf" in message
