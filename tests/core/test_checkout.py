"""eaglenest's own state (``.eaglenest/``) is the checkout's, also for a stage DVC runs in an experiment's copy."""

from __future__ import annotations

from pathlib import Path

import pytest

from eaglenest.core.checkout import checkout_path

STATE = Path(".eaglenest") / "train-checkpoints"


def test_state_stays_where_the_stage_runs_outside_an_experiment_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    assert checkout_path(STATE) == STATE  # no DVC: the stage script run by hand, or by torchrun
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    assert checkout_path(STATE) == STATE  # dvc repro and dvc exp run: the checkout is the working directory
    assert checkout_path(tmp_path / "abs") == tmp_path / "abs"


def test_a_queued_experiment_keeps_its_state_in_the_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`dvc queue start` runs each experiment in .dvc/tmp/exps/<tmp>/ with DVC_ROOT naming the checkout: the same
    path there, with the stage's own folder (a dvc.yaml below the root) kept."""
    checkout = tmp_path / "checkout"
    copy = checkout / ".dvc" / "tmp" / "exps" / "tmpa1b2c3"
    (copy / "sub").mkdir(parents=True)
    monkeypatch.setenv("DVC_ROOT", str(checkout))
    monkeypatch.chdir(copy)
    assert checkout_path(STATE) == checkout / STATE
    monkeypatch.chdir(copy / "sub")
    assert checkout_path(STATE) == checkout / "sub" / STATE
    assert checkout_path(Path("/shared/ckpt")) == Path("/shared/ckpt")  # cluster.torchrun.checkpoint_dir, absolute
    # the same checkout reached through a link is still the checkout
    (tmp_path / "link").symlink_to(checkout)
    monkeypatch.setenv("DVC_ROOT", str(tmp_path / "link"))
    monkeypatch.chdir(copy)
    assert checkout_path(STATE) == checkout / STATE
