"""The verifier stage on local models: recorded by reference, checked before any weights load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eaglenest.artifacts.verifier import INFO_FILE, load_tokenizer, load_verifier_info
from eaglenest.core.errors import EaglenestError, ParamsError
from eaglenest.stages.verifier import build_verifier, fingerprint_model_dir
from eaglenest.stages.verifier.params import VerifierParams
from tests.fixtures.models import build_tiny_verifier


def test_local_verifier_is_recorded_not_copied(tmp_path: Path, tiny_verifier_dir: Path):
    out = tmp_path / "models" / "verifier"
    info = build_verifier(VerifierParams(model=str(tiny_verifier_dir)), out)
    assert sorted(p.name for p in out.iterdir()) == [INFO_FILE]  # a pointer, never the weights
    recorded = json.loads((out / INFO_FILE).read_text())
    assert recorded["path"] == str(tiny_verifier_dir)
    assert recorded["kind"] == "local"
    assert (info.num_layers, info.hidden_size) == (8, 32)
    assert info.aux_layers == [2, 4, 5]  # [2, N//2, N-3]
    assert info.layer_ids == [2, 4, 5, 8]


def test_default_aux_layers_collide_on_a_6_layer_model(tmp_path: Path):
    model = build_tiny_verifier(tmp_path / "six", num_layers=6)
    # [2, 6//2, 6-3] = [2, 3, 3]: refused with the fix, not silently deduplicated.
    with pytest.raises(ParamsError, match=r"default aux layers \[2, 3, 3\].*collide.*set verifier.aux_layers"):
        build_verifier(VerifierParams(model=str(model)), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_explicit_aux_layers_and_fingerprint(tmp_path: Path, tiny_verifier_dir: Path):
    params = VerifierParams(model=str(tiny_verifier_dir), aux_layers=[4, 1, 2], name="org/tiny")
    info = build_verifier(params, tmp_path / "out")
    assert info.aux_layers == [1, 2, 4]
    assert info.layer_ids == [1, 2, 4, 8]
    assert info.name == "org/tiny"
    assert info.fingerprint == fingerprint_model_dir(tiny_verifier_dir)
    loaded, path = load_verifier_info(tmp_path / "out")
    assert loaded == info and path == tiny_verifier_dir
    assert load_tokenizer(tmp_path / "out").chat_template


def _copy_with_weights(source: Path, dest: Path, change) -> Path:
    """``source`` copied to ``dest`` with only model.safetensors rewritten: ``change(tensors)``; config.json,
    tokenizer and the rest are the same bytes."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, dest)
    tensors = load_file(source / "model.safetensors")
    change(tensors)
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    assert (dest / "config.json").read_bytes() == (source / "config.json").read_bytes()
    return dest


def test_fingerprint_changes_with_the_weights_layout_alone(tmp_path: Path, tiny_verifier_dir: Path):
    name = "model.layers.0.mlp.up_proj.weight"

    def to_half(tensors):
        tensors[name] = tensors[name].half()

    changed = _copy_with_weights(tiny_verifier_dir, tmp_path / "half", to_half)
    same = _copy_with_weights(tiny_verifier_dir, tmp_path / "same", lambda tensors: None)
    assert fingerprint_model_dir(same) == fingerprint_model_dir(tiny_verifier_dir)
    assert fingerprint_model_dir(changed) != fingerprint_model_dir(tiny_verifier_dir)


def test_fingerprint_changes_with_the_weights_values_alone(tmp_path: Path, tiny_verifier_dir: Path):
    """A fine-tune of the same shape: same config, same safetensors header, other bytes."""

    def perturb(tensors):
        tensors["model.layers.0.mlp.up_proj.weight"] += 0.01

    changed = _copy_with_weights(tiny_verifier_dir, tmp_path / "tuned", perturb)
    assert fingerprint_model_dir(changed) != fingerprint_model_dir(tiny_verifier_dir)


def test_aux_layer_outside_range_refused_before_weights(tmp_path: Path, tiny_verifier_dir: Path):
    with pytest.raises(ParamsError, match=r"ids \[8\] fall outside 1..7 for a 8-layer verifier"):
        build_verifier(VerifierParams(model=str(tiny_verifier_dir), aux_layers=[2, 8]), tmp_path / "out")


def test_remote_code_refused_unless_allowed(tmp_path: Path):
    model = build_tiny_verifier(tmp_path / "custom", auto_map=True)
    with pytest.raises(ParamsError, match=r"needs its own Python code.*verifier.trust_remote_code: true"):
        build_verifier(VerifierParams(model=str(model), aux_layers=[1, 2]), tmp_path / "out")


def test_unknown_builtin_and_missing_model(tmp_path: Path):
    with pytest.raises(ParamsError, match=r"unknown built-in; allowed: builtin:smollm2-135m-instruct"):
        build_verifier(VerifierParams(model="builtin:gpt5"), tmp_path / "out")
    with pytest.raises(ParamsError, match=r"'nope/not-cached': not a local directory, and not in the local Hugging"):
        build_verifier(VerifierParams(model="nope/not-cached"), tmp_path / "out")
    with pytest.raises(ParamsError, match=r"'./no/such/dir': no such directory"):
        build_verifier(VerifierParams(model="./no/such/dir"), tmp_path / "out")


def test_folder_without_config(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ParamsError, match=r"config.json does not exist; expected a model folder"):
        build_verifier(VerifierParams(model=str(tmp_path / "empty")), tmp_path / "out")


def test_missing_record_says_which_stage_to_run(tmp_path: Path):
    with pytest.raises(EaglenestError, match=r"verifier.json does not exist; run the verifier stage first"):
        load_verifier_info(tmp_path)


def test_weight_hashes_are_read_once_per_path_size_and_mtime(
    tmp_path: Path, tiny_verifier_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    import hashlib
    import os

    from eaglenest.stages import verifier as verifier_module

    model = _copy_with_weights(tiny_verifier_dir, tmp_path / "model", lambda tensors: None)
    cache = tmp_path / "hashes.json"
    first = fingerprint_model_dir(model, cache)
    reads = []
    real_sha256 = hashlib.sha256
    monkeypatch.setattr(verifier_module.hashlib, "sha256", lambda *a: reads.append(a) or real_sha256(*a))
    assert fingerprint_model_dir(model, cache) == first
    assert len(reads) == 1  # the folder digest only: the weights' hash came from the cache
    weights = model / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # touched: hashed again
    assert fingerprint_model_dir(model, cache) == first and len(reads) == 3
    assert json.loads(cache.read_text())[str(weights.resolve())]["mtime_ns"] == stat.st_mtime_ns + 1_000_000_000


def test_each_machine_names_its_copy_of_an_external_verifier(
    tmp_path: Path, tiny_verifier_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    """The record is the same on a machine whose copy lives elsewhere, and every stage loads that copy."""
    import shutil

    from eaglenest.artifacts.verifier import VERIFIER_PATH_ENV

    params = VerifierParams(model="/models/tiny-llama", aux_layers=[1, 3, 5])  # where no machine here keeps it
    here = build_verifier(VerifierParams(model=str(tiny_verifier_dir), aux_layers=[1, 3, 5]), tmp_path / "a")
    copy = shutil.copytree(tiny_verifier_dir, tmp_path / "my-copy")
    monkeypatch.setenv(VERIFIER_PATH_ENV, str(copy))
    info = build_verifier(params, tmp_path / "b")
    assert (info.path, info.source, info.kind, info.name) == (
        "/models/tiny-llama",
        "/models/tiny-llama",
        "local",
        "tiny-llama",
    )
    assert info.fingerprint == here.fingerprint  # the same weights, wherever they are
    assert load_verifier_info(tmp_path / "b") == (info, copy)
    monkeypatch.setenv(VERIFIER_PATH_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(ParamsError, match=f"{VERIFIER_PATH_ENV}=.*nowhere.*no such folder"):
        load_verifier_info(tmp_path / "b")
