"""train on a CUDA GPU: the path the CPU suite never runs (``train.device``, ``train.attention`` and
``train.precision`` all ``auto``: flex attention, speculators' fused loss, bf16 autocast). Skipped without a GPU."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eaglenest.artifacts.hidden_states.extract_params import ExtractParams
from eaglenest.stages.convert import convert
from eaglenest.stages.convert.params import ConvertParams
from eaglenest.stages.extract import extract_hidden_states
from eaglenest.stages.train import TrainPaths, finish_training, fit, setup_training, train_draft
from eaglenest.stages.train.params import TrainParams
from tests.fixtures.models import build_tiny_verifier
from tests.fixtures.pipeline import killed_and_resumed_training, pipeline_until_prepare

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (train.device auto: flex attention, fused loss, bf16)"
)

# Every device-dependent param left at auto; a checkpoint at step 4 and 8, validation at 0, 6 and 12.
AUTO = {
    "steps": 12,
    "eval_every": 6,
    "checkpoint_every": 4,
    "total_seq_len": 256,
    "lr": 3e-3,
    "warmup_steps": 2,
    "ttt_steps": 3,
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("train-cuda")
    # heads of 16: flex attention's GPU kernel has none below (the default tiny verifier's are 8)
    model = build_tiny_verifier(root / "model", hidden_size=64, num_heads=4)
    verifier_dir, prepared = pipeline_until_prepare(root, model, rows=40)
    extract_hidden_states(ExtractParams(), verifier_dir, prepared, root / "hs", root / "extract.json")
    convert(
        ConvertParams(draft_vocab_size=64),
        ExtractParams(),
        verifier_dir,
        prepared,
        root / "hs",
        root / "vocab",
        root / "data.json",
    )
    return {"verifier": verifier_dir, "prepared": prepared, "hs": root / "hs", "vocab": root / "vocab"}


def paths_in(data: dict[str, Path], out: Path) -> TrainPaths:
    return TrainPaths(
        verifier=data["verifier"],
        prepared=data["prepared"],
        hidden_states=data["hs"],
        vocab=data["vocab"],
        out=out / "draft",
        metrics=out / "train.json",
        details=out / "train_details.json",
        live_dir=out / "dvclive",
        checkpoints=out / "checkpoints",
    )


def test_auto_trains_on_the_gpu_with_flex_attention_in_bf16(converted: dict[str, Path], tmp_path: Path):
    with contextlib.ExitStack() as held:
        session = setup_training(TrainParams(**AUTO), paths_in(converted, tmp_path), held)
        runtime = session.runtime
        assert (runtime.device.type, runtime.attention, runtime.precision) == (
            "cuda",
            "simple_flex_attention",
            "bfloat16",
        )
        assert runtime.hs_dtype == torch.bfloat16
        assert session.model._attn_impl == "simple_flex_attention"  # what speculators' draft really runs
        assert next(session.model.parameters()).device.type == "cuda"
        metrics = finish_training(session, fit(session))

    assert metrics["device"] == "cuda" and metrics["precision"] == "bfloat16" and metrics["steps_this_run"] == 12
    host = metrics["host"]
    print(
        f"\ncuda train: {metrics['steps']} steps in {metrics['seconds']:.2f} s "
        f"({metrics['steps'] / metrics['seconds']:.2f} steps/s, validation included), "
        f"{metrics['tokens_per_s']} tokens/s, train loss {metrics['train_loss']}, val loss {metrics['val_loss']}, "
        f"val acc {metrics['val_acc']}, host {host['gpu']} ({host.get('compute_dtype')})"
    )
    assert math.isfinite(metrics["train_loss"]) and math.isfinite(metrics["val_loss"])
    val_losses = [
        float(line.split("\t")[1])
        for line in (tmp_path / "dvclive/plots/metrics/val/loss.tsv").read_text().splitlines()[1:]
    ]
    assert len(val_losses) == 3 and val_losses[-1] < val_losses[0], val_losses  # it learns
    assert metrics["tokens_per_s"] > 0
    assert host["gpu"].endswith(torch.cuda.get_device_name(0)) and host["compute_dtype"] == "bfloat16"
    weights = load_file(tmp_path / "draft/model.safetensors")
    assert weights["fc.weight"].dtype == torch.float32  # autocast leaves the weights in float32
    assert all(torch.isfinite(w).all() for w in weights.values() if w.is_floating_point())


def test_a_killed_gpu_run_resumes_from_its_checkpoint(
    converted: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    reference = train_draft(TrainParams(**AUTO), paths_in(converted, tmp_path / "a"))
    resumed = killed_and_resumed_training(TrainParams(**AUTO), paths_in(converted, tmp_path / "b"), monkeypatch, step=8)

    assert resumed["resumed_from_step"] == 8 and resumed["steps_this_run"] == 4 and resumed["device"] == "cuda"
    assert math.isfinite(resumed["val_loss"])
    a = load_file(tmp_path / "a/draft/model.safetensors")
    b = load_file(tmp_path / "b/draft/model.safetensors")
    assert a.keys() == b.keys()
    largest = max((a[n].float() - b[n].float()).abs().max().item() for n in a)
    print(
        f"\ncuda resume: uninterrupted val loss {reference['val_loss']}, resumed at step 8 {resumed['val_loss']}, "
        f"largest weight difference {largest:.3g}"
    )
    # GPU kernels (flex attention's backward, the fused loss) need not add in one order: close, not bit-equal.
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-2, atol=1e-4)
    assert resumed["val_loss"] == pytest.approx(reference["val_loss"], rel=0.02)
