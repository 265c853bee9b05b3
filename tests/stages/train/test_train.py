"""train: a tiny verifier's draft learns on CPU, saves a speculators checkpoint, resumes exactly."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import eaglenest.stages.train as train_module
from eaglenest.artifacts.hidden_states.extract_params import ExtractParams
from eaglenest.commands.params_file import parse_params
from eaglenest.core.errors import EaglenestError, ParamsError
from eaglenest.core.lock import LOCK_NAME
from eaglenest.stages.convert import convert
from eaglenest.stages.convert.params import ConvertParams
from eaglenest.stages.extract import extract_hidden_states
from eaglenest.stages.train import TrainPaths, train_draft
from eaglenest.stages.train.data import pack_batches
from eaglenest.stages.train.params import TrainParams
from eaglenest.stages.train.validation import tau_from_conditional
from tests.fixtures.fsync import record_fsyncs
from tests.fixtures.lock import held_by_another_process
from tests.fixtures.pipeline import REPO, killed_and_resumed_training, pipeline_until_prepare, read_curves

FAST = {"total_seq_len": 256, "lr": 3e-3, "warmup_steps": 2, "ttt_steps": 3}  # 3 TTT steps: two unscored positions


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory, tiny_verifier_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("train")
    verifier_dir, prepared = pipeline_until_prepare(root, tiny_verifier_dir, rows=40)
    hs = root / "hs"
    extract_hidden_states(ExtractParams(), verifier_dir, prepared, hs, root / "extract.json")
    convert(
        ConvertParams(draft_vocab_size=64),
        ExtractParams(dtype="bfloat16"),
        verifier_dir,
        prepared,
        hs,
        root / "vocab",
        root / "data.json",
    )
    return {
        "verifier": verifier_dir,
        "prepared": prepared,
        "hs": hs,
        "vocab": root / "vocab",
        "model": tiny_verifier_dir,
    }


def inputs_in(paths: dict[str, Path], out: Path) -> TrainPaths:
    return TrainPaths(
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


def read_tsv(path: Path) -> list[tuple[int, float]]:
    rows = path.read_text().splitlines()[1:]
    return [(int(r.split("\t")[0]), float(r.split("\t")[1])) for r in rows]


def test_draft_learns_and_saves_a_speculators_checkpoint(converted: dict[str, Path], tmp_path: Path):
    params = TrainParams(steps=20, eval_every=10, verifier_name=str(converted["model"]), **FAST)
    metrics = train_draft(params, inputs_in(converted, tmp_path))

    # Accuracy of the first TTT step rises clearly above the untrained draft's.
    acc = read_tsv(tmp_path / "dvclive/plots/metrics/val/acc_0.tsv")
    assert [step for step, _ in acc] == [0, 10, 20]
    assert acc[-1][1] > acc[0][1] + 0.1, acc
    assert len(read_tsv(tmp_path / "dvclive/plots/metrics/train/loss.tsv")) == 20
    assert metrics["steps"] == 20 and len(metrics["val_acc"]) == 3
    assert metrics["tau_sim"] == pytest.approx(tau_from_conditional(metrics["val_cond_acc"]), abs=1e-3)
    assert json.loads((tmp_path / "train_details.json").read_text()) == metrics
    # the declared metric: tau_sim and the validation loss, named by the tokens it covers (train.loss_tokens)
    assert json.loads((tmp_path / "train.json").read_text()) == {
        "tau_sim": metrics["tau_sim"],
        "val_loss_all_tokens": metrics["val_loss"],
    }

    config = json.loads((tmp_path / "draft/config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["norm_before_residual"] is True
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert config["draft_vocab_size"] == 64
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(converted["model"])
    weights = load_file(tmp_path / "draft/model.safetensors")
    assert weights["d2t"].shape == (64,) and weights["t2d"].shape == (300,)
    assert "verifier_lm_head.weight" not in weights

    from speculators import SpeculatorModel

    loaded = SpeculatorModel.from_pretrained(str(tmp_path / "draft"))
    assert type(loaded).__name__ == "Eagle3DraftModel"
    assert torch.equal(loaded.state_dict()["fc.weight"], weights["fc.weight"])
    # finished: no checkpoint left, only the lock file of the run's folder (it means nothing while nobody holds it)
    assert not any(path.is_dir() or not path.name.endswith(LOCK_NAME) for path in (tmp_path / "checkpoints").iterdir())


@pytest.mark.parametrize("optimizer", [{}, {"optimizer": "muon", "muon": {"lr": 0.01}}], ids=["adamw", "muon"])
def test_resume_after_a_kill_matches_an_uninterrupted_run(
    converted: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, optimizer: dict
):
    """Every optimizer's state and schedule come back from the checkpoint: Muon's momentum and AdamW's moments."""
    params = TrainParams(steps=12, eval_every=6, checkpoint_every=4, **FAST, **optimizer)
    reference = train_draft(params, inputs_in(converted, tmp_path / "a"))
    resumed = killed_and_resumed_training(params, inputs_in(converted, tmp_path / "b"), monkeypatch, step=8)

    assert resumed["resumed_from_step"] == 8 and resumed["steps_this_run"] == 4
    a = load_file(tmp_path / "a/draft/model.safetensors")
    b = load_file(tmp_path / "b/draft/model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)
    assert resumed["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)
    loss_steps = [step for step, _ in read_tsv(tmp_path / "b/dvclive/plots/metrics/train/loss.tsv")]
    assert loss_steps == list(range(1, 13))  # the history continues without duplicates
    # The curves logged before the kill came back from the checkpoint: every curve as the uninterrupted run's.
    assert read_curves(tmp_path / "b/dvclive") == read_curves(tmp_path / "a/dvclive")


def test_changed_params_never_resume_a_stale_run(
    converted: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    original = train_module.save_checkpoint

    def save_then_die(*args):
        original(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train_draft(TrainParams(steps=8, checkpoint_every=4, **FAST), inputs_in(converted, tmp_path))
    monkeypatch.setattr(train_module, "save_checkpoint", original)
    changed = {**FAST, "lr": 1e-3}
    metrics = train_draft(TrainParams(steps=8, checkpoint_every=4, **changed), inputs_in(converted, tmp_path))
    assert metrics["resumed_from_step"] == 0


def test_bad_params_are_refused_before_training(converted: dict[str, Path], tmp_path: Path):
    with pytest.raises(ParamsError) as info:
        parse_params({"train": {"ttt_steps": 0, "attention": "flash", "total_seq_len": 8}})
    text = str(info.value)
    assert "train.ttt_steps = 0: Input should be greater than or equal to 1" in text
    assert "train.attention = 'flash': Input should be 'auto', 'sdpa', 'eager' or 'simple_flex_attention'" in text
    assert "train.total_seq_len = 8" in text
    with pytest.raises(
        EaglenestError,
        match=r"train.total_seq_len = 16 is shorter than prepared row \d+ "
        r"\(\d+ tokens; \d+ rows in all\); raise it to at least \d+",
    ):
        train_draft(TrainParams(total_seq_len=16), inputs_in(converted, tmp_path))
    assert not (tmp_path / "draft").exists()


def test_precision_auto_follows_the_device(monkeypatch: pytest.MonkeyPatch):
    """bf16 autocast where the CPU multiplies bf16 natively, float32 where it would be emulated (slower)."""
    import eaglenest.stages.train.model as model_module

    layer = torch.nn.Linear(8, 8)
    for native, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(model_module, "cpu_has_native_bf16", lambda native=native: native)
        runtime = model_module.draft_runtime(TrainParams(), torch.device("cpu"))
        assert runtime.precision == str(expected).removeprefix("torch.")
        with runtime.autocast():
            assert layer(torch.ones(2, 8)).dtype == expected
    monkeypatch.setattr(model_module, "cpu_has_native_bf16", lambda: True)
    assert model_module.draft_runtime(TrainParams(precision="float32"), torch.device("cpu")).precision == "float32"
    # On a GPU hidden states are loaded in bf16 only for a bf16 draft: a float32 one needs float32 inputs.
    assert model_module.draft_runtime(TrainParams(), torch.device("cuda")).hs_dtype == torch.bfloat16
    assert model_module.draft_runtime(TrainParams(precision="float32"), torch.device("cuda")).hs_dtype == torch.float32


def test_the_fused_loss_kernels_get_autotune_configs_of_their_own():
    """On CUDA speculators compiles the draft's forward, and torch.compile refuses the one config list its fused
    loss kernels share; each gets its own, with the same candidates (test_train_cuda.py trains through it)."""
    pytest.importorskip("triton")
    from speculators.losses import fused

    from eaglenest.stages.train.model import separate_fused_loss_configs

    separate_fused_loss_configs()
    separate_fused_loss_configs()  # idempotent: draft_runtime calls it for every CUDA run
    forward, backward = fused.loss_forward_kernel.configs, fused.loss_backward_kernel.configs
    assert backward is not forward and not any(b is f for b, f in zip(backward, forward, strict=True))
    assert [(c.kwargs, c.num_warps, c.num_stages) for c in backward] == [
        (c.kwargs, c.num_warps, c.num_stages) for c in forward
    ]


def test_bf16_and_fp32_training_agree(converted: dict[str, Path], tmp_path: Path):
    """bf16 autocast only changes the arithmetic: the validation loss stays within 5 % of float32's, and the
    weights stay float32."""
    runs = {
        precision: train_draft(
            TrainParams(steps=10, eval_every=10, precision=precision, **FAST),
            inputs_in(converted, tmp_path / precision),
        )
        for precision in ("float32", "bfloat16")
    }
    assert runs["bfloat16"]["precision"] == "bfloat16" and runs["float32"]["precision"] == "float32"
    assert runs["bfloat16"]["val_loss"] == pytest.approx(runs["float32"]["val_loss"], rel=0.05)
    weights = load_file(tmp_path / "bfloat16/draft/model.safetensors")
    assert weights["fc.weight"].dtype == torch.float32  # autocast leaves the weights in float32


def test_loss_on_every_token_trains_prompts_too_and_validates_replies(converted: dict[str, Path], tmp_path: Path):
    """train.loss_tokens: all puts the loss on every position of a training batch, prompts included; the
    validation batches, and every batch under 'replies', keep prepare's loss mask (the assistant turns)."""
    from eaglenest.artifacts.verifier import load_verifier_info
    from eaglenest.stages.train.data import load_training_data

    verifier, _ = load_verifier_info(converted["verifier"])
    args = (verifier, converted["prepared"], converted["hs"], converted["vocab"], torch.float32)
    every = load_training_data(TrainParams(loss_tokens="all", **FAST), *args)
    replies = load_training_data(TrainParams(loss_tokens="replies", **FAST), *args)
    rows = every.rows["train"][:4]
    # speculators' shift drops each row's first position; the next ttt_steps - 1 stay unscored, or TTT step k
    # would score a chain at the end of one row against the first k targets of the next.
    positions = sum(every.lengths[r] - 1 - (3 - 1) for r in rows)
    reply_mask = replies.batch(rows, torch.device("cpu"), training=True)["loss_mask"]
    assert 0 < reply_mask.sum() < positions
    assert every.batch(rows, torch.device("cpu"), training=True)["loss_mask"].sum() == positions
    assert torch.equal(every.batch(rows, torch.device("cpu"))["loss_mask"], reply_mask)
    first_row = every.batch(rows[:1], torch.device("cpu"), training=True)["loss_mask"][0]  # [total_seq_len]
    assert first_row[:2].tolist() == [0, 0] and first_row[2 : every.lengths[rows[0]] - 1].all()

    metrics = {
        tokens: train_draft(
            TrainParams(steps=4, eval_every=4, loss_tokens=tokens, **FAST), inputs_in(converted, tmp_path / tokens)
        )
        for tokens in ("all", "replies")
    }
    assert metrics["all"]["loss_tokens"] == "all" and metrics["replies"]["loss_tokens"] == "replies"
    assert metrics["all"]["train_loss"] != metrics["replies"]["train_loss"]


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_keeps_the_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A full disk (torch's zip writer: "unexpected pos") stops training with one line naming the checkpoint;
    no temp file is left and the previous checkpoint still resumes."""
    from eaglenest.stages.train import checkpoint as checkpoint_module

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    optimizers, schedulers = [optimizer], [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)]
    path = tmp_path / "run" / "checkpoint.pt"
    checkpoint_module.save_checkpoint(path, model, optimizers, schedulers, 100, [(100, "train/loss", 2.5)])

    def disk_full(obj, f):
        f.write(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 88640 vs 88528")

    monkeypatch.setattr(checkpoint_module.torch, "save", disk_full)
    with pytest.raises(
        EaglenestError,
        match=r"could not write the training checkpoint .*checkpoint.pt at step 200 "
        r"\(\[enforce fail.*MiB free there\); free disk space",
    ):
        checkpoint_module.save_checkpoint(path, model, optimizers, schedulers, 200, [])
    assert sorted(p.name for p in path.parent.iterdir()) == ["checkpoint.pt"]
    monkeypatch.undo()
    assert checkpoint_module.resume(path, model, optimizers, schedulers) == (100, [(100, "train/loss", 2.5)])


def test_packing_is_deterministic_and_bounded():
    lengths = [10, 20, 30, 40, 50, 60]
    a = pack_batches(list(range(6)), lengths, 70, seed=1, epoch=0)
    assert a == pack_batches(list(range(6)), lengths, 70, seed=1, epoch=0)
    assert a != pack_batches(list(range(6)), lengths, 70, seed=1, epoch=1)
    assert sorted(sum(a, [])) == list(range(6))
    assert all(sum(lengths[r] for r in batch) <= 70 for batch in a)


def test_tau_from_conditional_accuracies():
    assert tau_from_conditional([1.0, 1.0, 1.0]) == 4.0
    assert tau_from_conditional([0.0, 1.0]) == 1.0
    assert tau_from_conditional([0.5, 0.5]) == pytest.approx(1.75)


def test_dvc_yaml_plots_one_accuracy_curve_per_ttt_step_of_the_default_draft():
    import re

    repo = REPO
    ttt_steps = yaml.safe_load((repo / "params.yaml").read_text())["train"]["ttt_steps"]
    assert ttt_steps == TrainParams().ttt_steps  # params.yaml states the default
    declared = re.findall(r"dvclive/train/plots/metrics/val/acc_(\d+)\.tsv", (repo / "dvc.yaml").read_text())
    # a curve for a step the draft does not have is a missing file: `dvc plots show` fails on it
    assert sorted(int(i) for i in declared) == list(range(ttt_steps))


# The other draft algorithms on the same data: speculators' classes, their checkpoint type and K, resume.
ALGORITHM_PARAMS = {"peagle": {"algorithm": "peagle"}, "dflash": {"algorithm": "dflash"}}
ALGORITHM_CLASSES = {"peagle": "PEagleDraftModel", "dflash": "DFlashDraftModel"}


@pytest.mark.parametrize("algorithm", ["peagle", "dflash"])
def test_every_algorithm_learns_and_saves_its_speculators_checkpoint(
    converted: dict[str, Path], tmp_path: Path, algorithm: str
):
    params = TrainParams(
        steps=20, eval_every=10, verifier_name=str(converted["model"]), **{**FAST, **ALGORITHM_PARAMS[algorithm]}
    )
    metrics = train_draft(params, inputs_in(converted, tmp_path))

    loss = read_tsv(tmp_path / "dvclive/plots/metrics/val/loss.tsv")
    assert [step for step, _ in loss] == [0, 10, 20] and loss[-1][1] < loss[0][1], loss
    assert metrics["algorithm"] == algorithm and len(metrics["val_acc"]) == 3 and metrics["val_cond_acc"] == []
    assert 1.0 <= metrics["tau_sim"] <= 4.0
    config = json.loads((tmp_path / "draft/config.json").read_text())
    assert config["speculators_model_type"] == algorithm
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3  # K = ttt_steps
    assert config["mask_token_id"] is not None

    from speculators import SpeculatorModel

    from eaglenest.artifacts.draft import draft_tokens, vllm_speculative_config

    assert type(SpeculatorModel.from_pretrained(str(tmp_path / "draft"))).__name__ == ALGORITHM_CLASSES[algorithm]
    assert draft_tokens(tmp_path / "draft", "--draft") == 3
    served = vllm_speculative_config(tmp_path / "draft", 3)
    assert served["method"] == {"peagle": "eagle3", "dflash": "dflash"}[algorithm]
    assert served.get("parallel_drafting", False) is (algorithm == "peagle")


@pytest.mark.parametrize("algorithm", ["peagle", "dflash"])
def test_every_algorithm_resumes_exactly(
    converted: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, algorithm: str
):
    """P-EAGLE samples its positions at random: the resumed run draws what the uninterrupted one drew."""
    params = TrainParams(steps=8, eval_every=8, checkpoint_every=4, **{**FAST, **ALGORITHM_PARAMS[algorithm]})
    reference = train_draft(params, inputs_in(converted, tmp_path / "a"))
    original = train_module.save_checkpoint

    def save_then_die(*args):
        original(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train_draft(params, inputs_in(converted, tmp_path / "b"))
    monkeypatch.setattr(train_module, "save_checkpoint", original)
    resumed = train_draft(params, inputs_in(converted, tmp_path / "b"))
    assert resumed["resumed_from_step"] == 4
    a = load_file(tmp_path / "a/draft/model.safetensors")
    b = load_file(tmp_path / "b/draft/model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)
    assert resumed["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)


def test_algorithm_params_are_refused_for_the_wrong_algorithm():
    with pytest.raises(ParamsError) as info:
        parse_params(
            {
                "train": {
                    "peagle": {"max_anchors": 64},
                    "norm_output": True,
                    "algorithm": "peagle",
                    "dflash": {"max_anchors": 8},
                }
            }
        )
    text = str(info.value)
    assert "train.dflash: only with train.algorithm: dflash (it is peagle)" in text
    assert "train.norm_output: not an option of train.algorithm: peagle" in text
    with pytest.raises(ParamsError, match="train.draft_arch = 'llama': a dflash draft has Qwen3-style layers"):
        parse_params({"train": {"algorithm": "dflash", "draft_arch": "llama"}})
    with pytest.raises(ParamsError, match=r"train.peagle.depth: unknown key \(allowed: down_sample_ratio"):
        parse_params({"train": {"algorithm": "peagle", "peagle": {"depth": 2}}})
    assert parse_params({"train": {"algorithm": "dflash", "draft_arch": "qwen3"}}).train.dflash is None
    # draft_arch: auto (the default) is the layer each algorithm is served with, so one -S switches algorithm.
    assert parse_params({"train": {"algorithm": "dflash"}}).train.draft_layer == "qwen3"
    assert parse_params({"train": {"algorithm": "peagle"}}).train.draft_layer == "llama"
    assert parse_params({"train": {"algorithm": "eagle3", "draft_arch": "qwen3"}}).train.draft_layer == "qwen3"
    with pytest.raises(ParamsError, match="train.algorithm"):  # not a name at all: reported, not a TypeError
        parse_params({"train": {"algorithm": [], "peagle": {"max_anchors": 64}}})


# The optimizer (train.optimizer): speculators' build_optimizers, AdamW alone or Muon over the matrices.
FROZEN = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_each_optimizer_moves_its_weights_and_never_the_frozen_ones(
    converted: dict[str, Path], tmp_path: Path, optimizer: str
):
    """adamw: AdamW over every trainable weight. muon: Muon over the draft layer's 2-D matrices (fc, attention and
    MLP projections), AdamW over the rest (the norms). speculators hands AdamW the frozen weights too (every named
    parameter); without gradients they never move and hold no optimizer state."""
    from eaglenest.stages.train import finish_training, fit, setup_training

    params = TrainParams(steps=6, eval_every=6, optimizer=optimizer, **FAST)
    with contextlib.ExitStack() as held:
        session = setup_training(params, inputs_in(converted, tmp_path), held)
        named = dict(session.model.named_parameters())
        before = {name: weight.detach().clone() for name, weight in named.items()}
        finish_training(session, fit(session))

    optimizers = session.optimization.optimizers
    assert [type(o).__name__ for o in optimizers] == (["Muon", "AdamW"] if optimizer == "muon" else ["AdamW"])
    names = {id(weight): name for name, weight in named.items()}
    stepped_by = {names[id(weight)]: type(o).__name__ for o in optimizers for weight in o.state}
    trainable = {name for name, weight in named.items() if weight.requires_grad}
    assert set(named) - trainable == FROZEN and not FROZEN & set(stepped_by)
    matrices = {name for name in trainable if named[name].ndim == 2}
    assert matrices == {
        "fc.weight",
        *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    }
    if optimizer == "muon":
        assert {name for name, kind in stepped_by.items() if kind == "Muon"} == matrices
        assert {name for name, kind in stepped_by.items() if kind == "AdamW"} == trainable - matrices
        assert all("momentum_buffer" in optimizers[0].state[named[name]] for name in matrices)
    else:
        assert set(stepped_by) == trainable
    for name, weight in named.items():
        assert torch.equal(weight, before[name]) == (name in FROZEN), name

    # train/lr is AdamW's either way; Muon's own follows the same warm-up and cosine from train.muon.lr (0.02)
    curves = tmp_path / "dvclive/plots/metrics/train"
    adamw_lr = read_tsv(curves / "lr.tsv")
    assert adamw_lr[0] == (1, pytest.approx(3e-3)) and len(adamw_lr) == 6
    if optimizer == "muon":
        muon_lr = read_tsv(curves / "muon_lr.tsv")
        assert [step for step, _ in muon_lr] == [step for step, _ in adamw_lr]
        assert [lr / 0.02 for _, lr in muon_lr] == pytest.approx([lr / 3e-3 for _, lr in adamw_lr])
    else:
        assert not (curves / "muon_lr.tsv").exists()
    loss = read_tsv(tmp_path / "dvclive/plots/metrics/val/loss.tsv")
    assert loss[-1][1] < loss[0][1], loss  # it learns
    assert json.loads((tmp_path / "train_details.json").read_text())["optimizer"] == optimizer


def test_a_checkpoint_of_the_other_optimizer_is_refused_in_one_line(converted: dict[str, Path], tmp_path: Path):
    """The run's fingerprint covers the optimizer, so a muon run never finds an adamw run's checkpoint; one put in its
    place by hand, or holding another draft's states, stops the stage with one line instead of a torch traceback."""
    from eaglenest.artifacts.verifier import load_verifier_info
    from eaglenest.stages.train import checkpoint as checkpoint_module
    from eaglenest.stages.train.optimization import build_optimization

    verifier, _ = load_verifier_info(converted["verifier"])
    inputs = (verifier, converted["prepared"], converted["vocab"], converted["hs"])
    fingerprints = {
        checkpoint_module.run_fingerprint(TrainParams(**settings), *inputs)
        for settings in ({}, {"optimizer": "muon"}, {"optimizer": "muon", "muon": {"lr": 0.01}})
    }
    assert len(fingerprints) == 3

    model = torch.nn.Linear(4, 4)  # a matrix for Muon, a bias for AdamW
    path = tmp_path / "run" / "checkpoint.pt"
    adamw, muon = (build_optimization(model, TrainParams(optimizer=name)) for name in ("adamw", "muon"))
    checkpoint_module.save_checkpoint(path, model, adamw.optimizers, adamw.schedulers, 4, [])
    with pytest.raises(EaglenestError) as info:
        checkpoint_module.resume(path, model, muon.optimizers, muon.schedulers)
    assert str(info.value) == (
        f"{path}: a checkpoint of a run with the optimizers AdamW, and this run trains with "
        f"Muon+AdamW (train.optimizer); delete {path.parent} to start afresh"
    )
    checkpoint_module.save_checkpoint(path, model, muon.optimizers, muon.schedulers, 4, [])
    assert checkpoint_module.resume(path, model, muon.optimizers, muon.schedulers) == (4, [])
    other = torch.nn.Linear(4, 8)  # another draft: its weights do not fit
    other_muon = build_optimization(other, TrainParams(optimizer="muon"))
    with pytest.raises(EaglenestError) as info:
        checkpoint_module.resume(path, other, other_muon.optimizers, other_muon.schedulers)
    assert "\n" not in str(info.value)
    assert str(info.value).startswith(f"{path}: does not fit this run's draft and optimizers (")
    assert str(info.value).endswith(f"); delete {path.parent} to start afresh")


def test_muon_params_are_refused_without_muon_and_default_to_speculators():
    from speculators.train.trainer import TrainerConfig

    from eaglenest.stages.train.params import MuonParams

    with pytest.raises(ParamsError) as info:
        parse_params({"train": {"muon": {"lr": 0.05}}})
    assert str(info.value).splitlines()[1:] == [
        "  - train.muon: only with train.optimizer: muon (it is adamw); remove train.muon or set train.optimizer: muon"
    ]
    with pytest.raises(ParamsError) as info:
        parse_params(
            {"train": {"optimizer": "muon", "muon": {"lr": 0, "momentum": 1.0, "ns_steps": 100, "adjust_lr_fn": "rms"}}}
        )
    text = str(info.value)
    for line in (
        "train.muon.lr = 0: Input should be greater than 0",
        "train.muon.momentum = 1.0: Input should be less than 1",
        "train.muon.ns_steps = 100: Input should be less than 100",
        "train.muon.adjust_lr_fn = 'rms': Input should be 'match_rms_adamw' or 'original'",
    ):
        assert line in text
    with pytest.raises(ParamsError, match=r"train.muon.beta: unknown key \(allowed: lr, momentum, weight_decay, "):
        parse_params({"train": {"optimizer": "muon", "muon": {"beta": 0.9}}})
    with pytest.raises(ParamsError, match="train.optimizer = 'sgd': Input should be 'adamw' or 'muon'"):
        parse_params({"train": {"optimizer": "sgd"}})
    # `-S train.optimizer=muon` alone: speculators' own Muon defaults
    train = parse_params({"train": {"optimizer": "muon"}}).train
    assert train.muon is None and train.muon_settings == MuonParams()
    defaults = TrainerConfig._field_defaults
    assert {name: defaults[f"muon_{name}"] for name in MuonParams.model_fields} == MuonParams().model_dump()
    assert parse_params({"train": {"optimizer": "adamw", "muon": None}}).train.muon is None


def test_a_torn_checkpoint_resumes_from_the_previous_one(
    converted: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    """Killed after its second checkpoint, which a power loss or a full disk tore: the rerun names it in one line and
    resumes from the first; the draft and the curves are the uninterrupted run's."""
    params = TrainParams(steps=6, eval_every=3, checkpoint_every=2, **FAST)
    reference = train_draft(params, inputs_in(converted, tmp_path / "a"))
    paths = inputs_in(converted, tmp_path / "b")
    original = train_module.save_checkpoint

    def save_then_die(path, model, optimizers, schedulers, done, curves):
        original(path, model, optimizers, schedulers, done, curves)
        if done == 4:
            raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train_draft(params, paths)
    monkeypatch.setattr(train_module, "save_checkpoint", original)
    newest = next(paths.checkpoints.glob("*/checkpoint.pt"))
    with open(newest, "r+b") as fh:
        fh.truncate(newest.stat().st_size // 2)
    shutil.rmtree(paths.live_dir)
    reason = _first_line_of_torch_load(newest)
    with caplog.at_level("WARNING"):
        resumed = train_draft(params, paths)
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"{newest}: unreadable checkpoint ({reason}), torn by a crash or a full disk?"
    ]
    assert resumed["resumed_from_step"] == 2 and resumed["steps_this_run"] == 4
    a, b = load_file(tmp_path / "a/draft/model.safetensors"), load_file(tmp_path / "b/draft/model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)
    assert resumed["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)
    assert read_curves(tmp_path / "b/dvclive") == read_curves(tmp_path / "a/dvclive")
    assert not newest.parent.exists()  # finished: the run's checkpoints are gone


def _first_line_of_torch_load(path: Path) -> str:
    try:
        torch.load(path, weights_only=True)
    except RuntimeError as err:
        return str(err).strip().splitlines()[0]
    raise AssertionError(f"{path} loads")


def test_with_no_readable_checkpoint_training_starts_from_step_0(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """The newest checkpoint zeroed (renamed in before its data reached the disk): the previous one resumes; that
    one torn too: one line, and a fresh start."""
    from eaglenest.stages.train import checkpoint as checkpoint_module

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    optimizers, schedulers = [optimizer], [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)]
    path = tmp_path / "run" / "checkpoint.pt"
    for step in (100, 200):
        checkpoint_module.save_checkpoint(path, model, optimizers, schedulers, step, [(step, "train/loss", 2.5)])
    assert sorted(p.name for p in path.parent.iterdir()) == ["checkpoint.prev.pt", "checkpoint.pt"]
    path.write_bytes(bytes(path.stat().st_size))
    assert checkpoint_module.resume(path, model, optimizers, schedulers) == (100, [(100, "train/loss", 2.5)])
    previous = path.with_name("checkpoint.prev.pt")
    previous.write_bytes(previous.read_bytes()[:100])
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert checkpoint_module.resume(path, model, optimizers, schedulers) == (0, [])
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 3 and lines[0].startswith(f"{path}: unreadable checkpoint (")
    assert lines[1].startswith(f"{previous}: unreadable checkpoint (")
    assert lines[2] == f"{path.parent}: no readable checkpoint; training starts again from step 0"


def test_checkpoints_are_fsynced_before_their_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A checkpoint renamed into place before its data reached the disk would come back from a power loss torn."""
    from eaglenest.stages.train import checkpoint as checkpoint_module

    synced = record_fsyncs(monkeypatch)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    checkpoint_module.save_checkpoint(
        tmp_path / "checkpoint.pt",
        model,
        [optimizer],
        [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)],
        1,
        [],
    )
    assert any(name.startswith(".checkpoint.pt.tmp-") for name in synced), synced


def test_a_second_training_of_the_same_run_is_refused_and_leaves_the_first_alone(
    converted: dict[str, Path], tmp_path: Path
):
    """Two trainings of one run (checkouts sharing cluster.torchrun.checkpoint_dir): the second meets rank 0's lock
    on the run's checkpoint folder before it reads or writes anything there."""
    from eaglenest.artifacts.verifier import load_verifier_info
    from eaglenest.core.lock import lock_file_for
    from eaglenest.stages.train import checkpoint as checkpoint_module

    params = TrainParams(steps=4, checkpoint_every=2, **FAST)
    paths = inputs_in(converted, tmp_path)
    verifier, _ = load_verifier_info(converted["verifier"])
    run_dir = paths.checkpoints / checkpoint_module.run_fingerprint(
        params, verifier, converted["prepared"], converted["vocab"], converted["hs"]
    )
    run_dir.mkdir(parents=True)
    (run_dir / "checkpoint.pt").write_bytes(b"the first training's checkpoint, being written")
    with held_by_another_process(lock_file_for(run_dir)) as pid, pytest.raises(EaglenestError) as info:
        train_draft(params, paths)
    assert str(info.value) == (
        f"{run_dir} is being written by pid {pid} on {socket.gethostname()} (lock "
        f"{lock_file_for(run_dir)}): wait for it to finish or stop it, then run again"
    )
    assert [p.name for p in run_dir.iterdir()] == ["checkpoint.pt"]
    assert (run_dir / "checkpoint.pt").read_bytes() == b"the first training's checkpoint, being written"
    assert not paths.out.exists() and not paths.metrics.exists()
