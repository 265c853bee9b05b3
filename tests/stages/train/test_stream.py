"""extract.store: stream: a pool of engine processes computes the trainer's batches ahead, in the plan's order; the
draft equals the one stored shards train, whatever engine computed what, also when an engine is killed mid-stream
or the trainer is stopped and resumed. Ray's engines are tested in tests/stages/extract/test_ray_executor.py."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import eaglenest.stages.train as train_module
from eaglenest.artifacts.hidden_states.online import MANIFEST_FILE
from eaglenest.artifacts.hidden_states.stream import HiddenStateStream
from eaglenest.commands.params_file import parse_params
from eaglenest.core.errors import EaglenestError, ParamsError
from eaglenest.core.params import ClusterParams
from tests.conftest import requires_vllm
from tests.fixtures.cluster import command_line, descendants, engine_processes, wait_until_gone
from tests.fixtures.pipeline import pipeline_until_prepare, run_train_stage, stage_wrapper
from tests.stages.train.test_online import FAST, extract_and_convert, train_in

ROWS = 24
# A forward per row: stored and streamed rows are computed alike, so the drafts are equal bit for bit.
ROW_BY_ROW = {"batch_tokens": 0}


def weights(paths: dict[str, Path], name: str) -> dict[str, torch.Tensor]:
    return load_file(paths["out"] / name / "draft" / "model.safetensors")


def assert_same_draft(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, tiny_verifier_dir: Path) -> dict[str, dict[str, Path]]:
    """The stored extraction's draft (the reference), and the stream's manifest and vocabulary."""
    root = tmp_path_factory.mktemp("stream")
    pipeline_until_prepare(root, tiny_verifier_dir, rows=ROWS)
    stored = extract_and_convert(root, "files", **ROW_BY_ROW)
    train_in(stored, "reference")
    return {"stored": stored, "streamed": extract_and_convert(root, "stream", **ROW_BY_ROW)}


def test_a_streamed_draft_is_the_stored_draft_bit_for_bit_and_nothing_is_stored(pipeline: dict):
    stored, streamed = pipeline["stored"], pipeline["streamed"]
    assert [p.name for p in streamed["hs"].iterdir()] == [MANIFEST_FILE]
    assert json.loads((streamed["out"] / "data.json").read_text())["bytes"] == 0
    assert (streamed["vocab"] / "rows.json").read_text() == (stored["vocab"] / "rows.json").read_text()

    metrics = train_in(streamed, "two-engines", ClusterParams(workers=2))
    assert_same_draft(weights(stored, "reference"), weights(streamed, "two-engines"))
    assert metrics["hidden_states"] == "stream"
    figures = metrics["stream"]
    assert (figures["executor"], figures["engines"], figures["stream_buffer"]) == ("local", 2, 4)
    # Every training batch and three validations (the untrained draft's, after steps 4 and 8) came through it.
    assert figures["batches"] > FAST["steps"] and figures["rows"] > 0
    assert 0 <= figures["wait_share"] <= 1 and figures["engine_rows_per_s"] > 0
    assert 0 <= figures["mean_buffer_fill"] < figures["stream_buffer"]
    details = json.loads((streamed["out"] / "two-engines" / "train_details.json").read_text())
    assert details["stream"] == figures


def test_an_engine_killed_mid_stream_changes_nothing(
    pipeline: dict, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    killed: list[int] = []
    original = HiddenStateStream.next_batch

    def kill_an_engine_on_the_third_batch(self: HiddenStateStream, rows: list[int]) -> dict:
        if self.meter is not None and self.meter.batches == 2 and not killed:
            engines = [pid for pid in descendants(os.getpid()) if "spawn_main" in command_line(pid)]
            assert engines, [(pid, command_line(pid)) for pid in descendants(os.getpid())]
            os.kill(engines[0], signal.SIGKILL)
            killed.append(engines[0])
        return original(self, rows)

    monkeypatch.setattr(HiddenStateStream, "next_batch", kill_an_engine_on_the_third_batch)
    streamed = pipeline["streamed"]
    train_in(streamed, "killed-engine", ClusterParams(workers=1))
    assert killed and any("an engine process died" in message for message in caplog.messages)
    assert_same_draft(weights(pipeline["stored"], "reference"), weights(streamed, "killed-engine"))


def test_a_stopped_trainer_resumes_its_stream_at_the_batch_it_needs(pipeline: dict, monkeypatch: pytest.MonkeyPatch):
    streamed, original = pipeline["streamed"], train_module.save_checkpoint

    def save_then_die(*args):
        original(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train_in(streamed, "resumed")
    monkeypatch.setattr(train_module, "save_checkpoint", original)
    resumed = train_in(streamed, "resumed")
    assert resumed["resumed_from_step"] == 4
    assert_same_draft(weights(pipeline["stored"], "reference"), weights(streamed, "resumed"))


def test_a_stream_refuses_a_batch_its_plan_does_not_hold(pipeline: dict):
    streamed = pipeline["streamed"]
    manifest = json.loads((streamed["hs"] / MANIFEST_FILE).read_text())
    from eaglenest.artifacts.prepared import load_input_ids
    from eaglenest.artifacts.verifier import load_verifier_info

    verifier, model_dir = load_verifier_info(streamed["verifier"])
    stream = HiddenStateStream(manifest, verifier, model_dir, load_input_ids(streamed["prepared"]), ClusterParams())
    try:
        stream.start(iter([[0, 1], [2]]))
        assert sorted(stream.next_batch([0, 1])) == [0, 1]
        with pytest.raises(EaglenestError, match=r"plan and training disagree: training asked for rows \[3\]"):
            stream.next_batch([3])
    finally:
        stream.close()


# The train stage, killed with SIGKILL as soon as it has written its first checkpoint (step 4 of FAST's 8).
SIGKILL_AFTER_CHECKPOINT = stage_wrapper(
    """\
import signal

import eaglenest.stages.train as train

save = train.save_checkpoint


def save_then_die(*args):
    save(*args)
    os.kill(os.getpid(), signal.SIGKILL)


train.save_checkpoint = save_then_die
"""
)


@pytest.mark.slow  # a Ray cluster of 3 nodes (tests/fixtures/cluster.py), and the stage run twice in a process
def test_a_trainer_killed_while_ray_engines_stream_takes_them_with_it_and_resumes_to_the_stored_draft(
    pipeline: dict, ray_cluster: Any, tmp_path: Path
):
    """The train stage streaming from the cluster's actors is SIGKILLed after its step-4 checkpoint: its actors
    die with it (Ray's owner fate-sharing), and the stage run again resumes at step 4, streams from there and
    ends with the stored draft bit for bit."""
    streamed, data = pipeline["streamed"], tmp_path / "data"
    data.mkdir()
    for name in ("verifier", "prepared", "hs", "vocab"):
        (data / name).symlink_to(streamed[name])
    wrapper = tmp_path / "die_after_checkpoint.py"
    wrapper.write_text(SIGKILL_AFTER_CHECKPOINT)
    sections = {
        "cluster": {"executor": "ray", "address": ray_cluster.address},
        "extract": {"store": "stream", "dtype": "bfloat16", **ROW_BY_ROW},
    }
    run = tmp_path / "run"

    killed = run_train_stage(run, data, FAST, script=wrapper, **sections)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert wait_until_gone(engine_processes()) == [], "the killed trainer's actors outlived it"
    resumed = run_train_stage(run, data, FAST, **sections)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    details = json.loads((run / "train_details.json").read_text())
    assert (details["resumed_from_step"], details["stream"]["executor"]) == (4, "ray")
    assert_same_draft(weights(pipeline["stored"], "reference"), load_file(run / "draft" / "model.safetensors"))


@pytest.mark.slow  # a Ray cluster of 3 nodes (tests/fixtures/cluster.py) and engines that load a model
def test_ray_engines_stream_the_same_draft_also_when_one_is_killed(
    pipeline: dict, ray_cluster: Any, monkeypatch: pytest.MonkeyPatch
):
    killed: list[int] = []
    original = HiddenStateStream.next_batch

    def kill_an_actor_on_the_third_batch(self: HiddenStateStream, rows: list[int]) -> dict:
        if self.meter is not None and self.meter.batches == 2 and not killed:
            actors = engine_processes()
            assert actors, "no engine actor to kill"
            os.kill(actors[0], signal.SIGKILL)
            killed.append(actors[0])
        return original(self, rows)

    monkeypatch.setattr(HiddenStateStream, "next_batch", kill_an_actor_on_the_third_batch)
    streamed = pipeline["streamed"]
    metrics = train_in(streamed, "ray", ClusterParams(executor="ray", address=ray_cluster.address))
    assert killed and (metrics["stream"]["executor"], metrics["stream"]["engines"]) == ("ray", 3)
    assert_same_draft(weights(pipeline["stored"], "reference"), weights(streamed, "ray"))
    assert wait_until_gone(engine_processes()) == [], "the stream's actors outlived training"


def test_stream_params_refuse_what_cannot_work():
    with pytest.raises(ParamsError) as err:
        parse_params({"extract": {"store": "stream", "backend": "import", "import_path": "x", "stream_buffer": 0}})
    message = str(err.value)
    assert "extract.backend: import only copies stored files (set extract.backend: hf or vllm" in message
    assert "extract.stream_buffer" in message  # at least one batch ahead
    parse_params({"extract": {"store": "stream", "backend": "vllm"}})  # vLLM engines stream too


def _shapes(engine: Any, task: list[int]) -> dict[int, tuple[int, ...]]:
    """A stream task for the vLLM engine test: its rows' hidden-state shapes (module level: engine processes pickle
    it)."""
    rows: dict[int, tuple[int, ...]] = {}
    input_ids = {row: list(range(100 + row, 140 + 7 * row)) for row in task}
    engine.compute(task, input_ids, lambda row, stored: rows.__setitem__(row, tuple(stored.shape)))
    return rows


@pytest.mark.slow
@requires_vllm
def test_a_local_stream_of_vllm_engines_ends_with_its_engine_processes(tmp_path: Path):
    """extract.backend vllm in a local stream's engine process: every task's hidden states come back, and the stream
    ends (its pool shut down) within a minute, vLLM's engine core with it. A process pool's worker exits without
    atexit hooks and joins its children, so an engine closed only by dropping its reference kept the pool's shutdown
    waiting for ever."""
    import functools
    import threading

    from eaglenest.artifacts.hidden_states.engines import make_engine
    from eaglenest.artifacts.hidden_states.engines.contract import EngineSettings
    from eaglenest.artifacts.hidden_states.extract_params import ExtractParams
    from eaglenest.artifacts.verifier import load_verifier_info
    from eaglenest.core.executor import LocalExecutor
    from eaglenest.stages.verifier import build_verifier
    from eaglenest.stages.verifier.params import VerifierParams
    from tests.fixtures.models import build_tiny_verifier

    model = build_tiny_verifier(tmp_path / "model32", hidden_size=128, num_heads=4)  # heads vLLM's CPU build runs
    build_verifier(VerifierParams(model=str(model), aux_layers=[1, 3, 5]), tmp_path / "verifier")
    info, model_dir = load_verifier_info(tmp_path / "verifier")
    settings = EngineSettings(info, model_dir.resolve(), ExtractParams(backend="vllm", dtype="float32"), 96)
    results: list[dict[int, tuple[int, ...]]] = []

    def consume() -> None:
        stream = LocalExecutor(1).stream(functools.partial(make_engine, settings), _shapes, [[0, 1], [2, 3]], 2)
        results.extend(result for _, result in stream)

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    consumer.join(timeout=300)
    assert not consumer.is_alive(), f"the stream did not end; results so far: {results}"
    assert results == [{0: (40, 4, 128), 1: (46, 4, 128)}, {2: (52, 4, 128), 3: (58, 4, 128)}]
    left = [pid for pid in descendants(os.getpid()) if "EngineCore" in command_line(pid)]
    assert wait_until_gone(left) == []
