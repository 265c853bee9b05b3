"""Experiments, queued experiments, metrics diff, the offline report and a DVC remote, on a tiny configuration, with
real DVC."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
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
    for stage in ("verifier", "prepare", "extract", "convert", "train", "free_sweep", "k_sweep"):
        assert f"Running stage '{stage}'" not in result.stdout
    timed = dvc(["exp", "run", "-S", "evaluate.timed_prompts=4"], tiny_repo)
    assert "Running stage 'evaluate'" in timed.stdout and "Running stage 'free_sweep'" in timed.stdout
    assert "Running stage 'k_sweep'" not in timed.stdout
    shared = dvc(["exp", "run", "-S", "evaluate.bootstrap_samples=500"], tiny_repo)
    for stage in ("evaluate", "free_sweep", "k_sweep"):
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


TASK_STATUSES = ("Queued", "Running", "Success", "Failed")


def queue_status(repo: Path) -> dict[str, str]:
    """`dvc queue status`'s table (it has no --json): experiment name -> its task's status."""
    rows = [row.split() for row in dvc(["queue", "status"], repo).stdout.splitlines()]
    return {cells[1]: cells[-1] for cells in rows if len(cells) >= 3 and cells[-1] in TASK_STATUSES}


def output_digests(repo: Path) -> dict[str, str]:
    """The workspace's params, lock and every output file, by path, as sha256 of their bytes."""
    files = [repo / "params.yaml", repo / "dvc.lock"]
    for folder in ("models/draft", "metrics", "dvclive", "data/prepared", "data/hidden_states", "data/vocab"):
        files += sorted(path for path in (repo / folder).rglob("*") if path.is_file())
    return {str(path.relative_to(repo)): hashlib.sha256(path.read_bytes()).hexdigest() for path in files}


@pytest.mark.slow
def test_queued_experiments_run_by_dvc_queue_start(tiny_pipeline: SharedPipeline, tmp_path: Path):
    """`dvc exp run --queue` twice, then `dvc queue start` (one worker): DVC runs each experiment in a temporary copy
    of the checkout (.dvc/tmp/exps/); both train afresh with their own params, keep their training checkpoints in
    the checkout's .eaglenest/ (where a killed one would resume when queued again), succeed with metrics of their
    own, and leave the workspace's outputs as they were."""
    repo = tiny_pipeline.copy(tmp_path / "repo")
    (repo / ".gitignore").write_text(".eaglenest/\n")  # as the project's own .gitignore: state, never committed
    shutil.rmtree(repo / ".eaglenest", ignore_errors=True)
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "baseline run"], repo)
    before = output_digests(repo)

    dvc(["exp", "run", "--queue", "-n", "adamw", "-S", "train.optimizer=adamw", *SHORT_TRAINING], repo)
    # ++ adds train.muon, which params.yaml leaves out (docs/training.md)
    dvc(
        [
            "exp",
            "run",
            "--queue",
            "-n",
            "muon",
            "-S",
            "train.optimizer=muon",
            "-S",
            "++train.muon.lr=0.01",
            *SHORT_TRAINING,
        ],
        repo,
    )
    assert queue_status(repo) == {"adamw": "Queued", "muon": "Queued"}
    started = time.monotonic()
    try:
        dvc(["queue", "start"], repo)
        while set(queue_status(repo).values()) & {"Queued", "Running"}:
            assert time.monotonic() - started < 900, dvc(["queue", "logs", "adamw"], repo, check=False).stdout
            time.sleep(5)
    finally:
        dvc(["queue", "stop"], repo, check=False)  # the worker: no process of the test outlives it
    status = queue_status(repo)
    logs = {name: dvc(["queue", "logs", name], repo).stdout for name in ("adamw", "muon")}
    assert status == {"adamw": "Success", "muon": "Success"}, logs

    for log in logs.values():
        assert "Running stage 'train'" in log and "Running stage 'evaluate'" in log
        for stage in ("verifier", "prepare", "extract", "convert"):
            assert f"Running stage '{stage}'" not in log
        assert "resuming run" not in log  # each trained from step 0: the other's checkpoints have another key
    diff = json.loads(dvc(["exp", "diff", "adamw", "muon", "--json"], repo).stdout)
    loss = diff["metrics"]["metrics/train.json"]["val_loss_all_tokens"]
    assert loss["old"] != loss["new"]
    params = diff["params"]["params.yaml"]
    assert (params["train.optimizer"]["old"], params["train.optimizer"]["new"]) == ("adamw", "muon")
    assert params["train.muon.lr"]["new"] == 0.01
    shown = dvc(["exp", "show", "--json"], repo).stdout
    assert "adamw" in shown and "muon" in shown

    # The checkpoints went to the checkout, not the deleted copies; both runs finished, so none is left.
    checkpoints = repo / ".eaglenest" / "train-checkpoints"
    assert checkpoints.is_dir() and not any(checkpoints.rglob("checkpoint.pt"))
    assert output_digests(repo) == before
    assert run(["git", "status", "--porcelain"], repo).stdout == ""
