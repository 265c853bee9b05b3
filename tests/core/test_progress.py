"""Progress on long steps: tqdm's meter (count, rate, ETA) as timestamped log lines when the output is not a
terminal, at most one per interval; the verifier's weight hashing advances a meter in bytes; the train stage's
log shows its steps with the loss."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import pytest

from eaglenest.core import progress as progress_module
from eaglenest.core.progress import progress
from eaglenest.core.vllm_support import vllm_meter
from eaglenest.stages.verifier import content_hash
from tests.fixtures.pipeline import run_train_stage

METER = re.compile(r"(\d+)/(\d+) \[[\d:]+<[\d:?]+, +[\d.?]+\w*/s")  # "3/10 [00:01<00:02, 2.50row/s"


def _meter_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "eaglenest.progress"]


def test_a_meter_in_a_log_is_whole_lines_with_rate_and_eta(caplog, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    caplog.set_level(logging.INFO, logger="eaglenest.progress")
    monkeypatch.setattr(progress_module, "LOG_INTERVAL", 0.0)
    with progress(10, "extract (hf)", "row") as meter:
        for _ in range(10):
            meter.update(1)
            meter.set_postfix(tok_s="123", refresh=False)
    lines = _meter_lines(caplog)
    assert lines and all("\r" not in line and "\n" not in line for line in lines)
    assert all(line.startswith("extract (hf):") for line in lines)
    assert METER.search(lines[-1]) and "10/10" in lines[-1] and "tok_s=123" in lines[-1]
    assert len(lines) == len(set(lines))  # the closing redraw of the same meter is not logged twice


def test_a_nested_meter_leaves_no_cursor_moves_in_a_log(caplog, monkeypatch):
    """vLLM's per-request meter inside ours (position 1): tqdm moves the cursor up around it."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    caplog.set_level(logging.INFO, logger="eaglenest.progress")
    monkeypatch.setattr(progress_module, "LOG_INTERVAL", 0.0)
    with progress(4, "regenerated", "conv") as outer:
        with progress(2, "a batch", "req", position=1, leave=False) as inner:
            inner.update(2)
        outer.update(4)
    lines = _meter_lines(caplog)
    assert lines and all("\x1b" not in line and line.strip() for line in lines), lines
    assert all(line.startswith(("regenerated:", "a batch:")) for line in lines), lines


def test_a_meter_in_a_log_writes_at_most_one_line_per_interval(caplog, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    caplog.set_level(logging.INFO, logger="eaglenest.progress")
    monkeypatch.setattr(progress_module, "LOG_INTERVAL", 3600.0)
    with progress(1000, "train", "step") as meter:
        for _ in range(1000):
            meter.update(1)
    lines = _meter_lines(caplog)
    assert len(lines) <= 3 and "1000/1000" in lines[-1]  # the first, maybe one more, and the last


def test_vllm_meter_names_the_step_not_vllms_words(caplog, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    caplog.set_level(logging.INFO, logger="eaglenest.progress")
    make = vllm_meter("prepare: regenerate")
    # As vLLM's offline runner calls it: first over the prompts it renders (vllm.utils.tqdm_utils.maybe_tqdm) ...
    assert list(make([[1, 2], [3]], desc="Rendering prompts")) == [[1, 2], [3]]
    assert _meter_lines(caplog) == []  # a moment's work: silent
    # ... then for the requests it runs.
    meter = make(total=4, desc="Processed prompts", dynamic_ncols=True, postfix="est. speed input: 0.00 toks/s")
    meter.update(4)
    meter.close()
    line = _meter_lines(caplog)[-1]
    assert line.startswith("prepare: regenerate:") and "4/4" in line and "Processed prompts" not in line


def test_vllm_meter_runs_under_vllms_own_helper(monkeypatch):
    """vLLM's own helper, whose call once broke the meter (the prompts passed where a count was expected)."""
    tqdm_utils = pytest.importorskip("vllm.utils.tqdm_utils")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    rendered = tqdm_utils.maybe_tqdm([[1], [2], [3]], use_tqdm=vllm_meter("evaluate"), desc="Rendering")
    assert list(rendered) == [[1], [2], [3]]


def test_weight_hashing_advances_a_byte_meter_whether_read_or_remembered(tmp_path: Path):
    class Meter:
        counted = 0

        def update(self, n: int) -> None:
            self.counted += n

    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\1" * 5000)
    cache = tmp_path / "hashes.json"
    for _ in range(2):  # read, then remembered
        meter = Meter()
        assert len(content_hash(weights, cache, meter=meter)) == 64
        assert meter.counted == 5000


def test_the_train_stage_logs_timestamped_steps_with_the_loss(tmp_path: Path, tiny_verifier_dir: Path):
    from tests.fixtures.pipeline import equal_length_training_data

    equal_length_training_data(tmp_path, tiny_verifier_dir)
    result = run_train_stage(
        tmp_path / "run", tmp_path, {"steps": 4, "eval_every": 4, "total_seq_len": 192, "precision": "float32"}
    )
    assert result.returncode == 0, result.stdout + result.stderr
    log = result.stdout + result.stderr
    assert "\r" not in log  # not a terminal: lines, not a redrawn bar
    steps = [line for line in log.splitlines() if " eaglenest train: optimizer steps:" in line]
    assert steps and re.match(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d eaglenest train: optimizer steps: ", steps[-1])
    # one prefix per line: no message repeats the stage's name after run_stage's "eaglenest train: "
    lines = [line for line in log.splitlines() if "eaglenest train: " in line]
    assert lines and all(line.count("eaglenest") == 1 for line in lines)
    assert not [line for line in lines if line.partition("eaglenest train: ")[2].startswith("train")]
    assert "4/4" in steps[-1] and "loss=" in steps[-1] and "tok_s=" in steps[-1]
