"""Experiments, metrics diff, the offline report and a DVC remote, on a tiny configuration, with real DVC."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from eaglenest.commands.report import write_report
from tests.fixtures.pipeline import SharedPipeline, dvc, run


@pytest.fixture(scope="module")
def tiny_repo(tiny_pipeline: SharedPipeline, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the shared tiny pipeline with its outputs committed (the base revision)."""
    repo = tiny_pipeline.copy(tmp_path_factory.mktemp("exp") / "repo")
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "baseline run"], repo)
    return repo


# Both experiments train a tenth of the base run's steps: what is compared is their learning rates, not the size.
SHORT_TRAINING = ["-S", "train.steps=12", "-S", "train.eval_every=6"]


@pytest.mark.slow
def test_two_experiments_diff_and_report(tiny_repo: Path, tmp_path: Path):
    dvc(["exp", "run", "-n", "lr-high", "-S", "train.lr=0.01", *SHORT_TRAINING], tiny_repo)
    dvc(["exp", "run", "-n", "lr-low", "-S", "train.lr=0.0001", *SHORT_TRAINING], tiny_repo)
    shown = dvc(["exp", "show", "--json"], tiny_repo).stdout
    assert "lr-high" in shown and "lr-low" in shown

    diff = json.loads(dvc(["exp", "diff", "lr-low", "lr-high", "--json"], tiny_repo).stdout)
    changed = diff["metrics"]["metrics/train.json"]
    assert "val_loss_all_tokens" in changed
    assert changed["val_loss_all_tokens"]["old"] != changed["val_loss_all_tokens"]["new"]
    params = diff["params"]["params.yaml"]
    assert (params["train.lr"]["old"], params["train.lr"]["new"]) == (0.0001, 0.01)
    assert "train.steps" not in params  # the same in both: only what differs is shown

    report = write_report(tiny_repo, ["lr-low", "lr-high"], "HEAD", tmp_path / "report")
    text = report.read_text()
    assert "| train.val_loss_all_tokens |" in text and "lr-high (change)" in text
    images = sorted((tmp_path / "report").glob("*.png"))
    assert {p.name for p in images} >= {"loss.png", "val_accuracy.png", "acceptance.png", "tau_per_category.png"}
    for image in images:
        assert image.stat().st_size > 5000 and image.name in text
    from PIL import Image

    pixels = Image.open(tmp_path / "report/loss.png").convert("L")
    assert len(set(pixels.getdata())) > 20  # lines and labels drawn, not a blank canvas


@pytest.mark.slow
def test_evaluate_only_change_reruns_only_evaluate(tiny_repo: Path):
    """A key only evaluate reads re-runs evaluate alone; one the sweeps time with re-runs them too: the timed turns
    the n-gram sweep (it tunes on the turns after them), the bootstrap both."""
    result = dvc(["exp", "run", "-S", "evaluate.bf16_tie_margin=0.4"], tiny_repo)
    assert "Running stage 'evaluate'" in result.stdout
    for stage in ("verifier", "prepare", "extract", "convert", "train", "ngram_sweep", "k_sweep"):
        assert f"Running stage '{stage}'" not in result.stdout
    timed = dvc(["exp", "run", "-S", "evaluate.timed_prompts=4"], tiny_repo)
    assert "Running stage 'evaluate'" in timed.stdout and "Running stage 'ngram_sweep'" in timed.stdout
    assert "Running stage 'k_sweep'" not in timed.stdout
    shared = dvc(["exp", "run", "-S", "evaluate.bootstrap_samples=500"], tiny_repo)
    for stage in ("evaluate", "ngram_sweep", "k_sweep"):
        assert f"Running stage '{stage}'" in shared.stdout
    assert "Running stage 'train'" not in shared.stdout


@pytest.mark.slow
def test_invalid_override_fails_with_the_params_error(tiny_repo: Path):
    result = dvc(["exp", "run", "-S", "train.lr=-1"], tiny_repo, check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "train.lr = -1" in output and "greater than 0" in output
    assert "Traceback" not in output


@pytest.mark.slow
def test_remote_push_clone_pull_repro_is_a_no_op(tiny_repo: Path, tmp_path: Path):
    remote = tmp_path / "remote"
    dvc(["remote", "add", "-d", "local", str(remote)], tiny_repo)
    run(["git", "add", ".dvc/config"], tiny_repo)
    run(["git", "commit", "-qm", "remote"], tiny_repo)
    dvc(["push", "--all-commits"], tiny_repo)  # the workspace holds the last experiment; the clone wants HEAD
    clone = tmp_path / "clone"
    run(["git", "clone", "-q", str(tiny_repo), str(clone)], tmp_path)
    dvc(["pull"], clone)
    assert (clone / "models/draft/model.safetensors").is_file()
    status = dvc(["repro"], clone).stdout
    assert "Running stage" not in status, status
    shutil.rmtree(clone)
