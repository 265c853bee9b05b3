"""The executor's offer to a stage, its dispatcher's actor states, and its refusals; a Ray cluster's own behaviour
is tested in tests/stages/extract/test_ray_executor.py."""

from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from eaglenest.core.errors import EaglenestError
from eaglenest.core.executor import (
    ActorState,
    LocalExecutor,
    RayExecutor,
    _Actor,
    check_cluster,
    connect,
    describe_cluster,
    in_this_process,
)
from eaglenest.core.params import ClusterParams
from tests.fixtures.cluster import wait_until_gone
from tests.fixtures.pipeline import REPO, project_env

NO_RAY = r"^cluster.executor: ray needs Ray, which this interpreter lacks; run `make setup` "


def test_the_local_executor_runs_engines_in_the_driver_and_tasks_write_into_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.chdir(tmp_path)
    executor = LocalExecutor()
    assert executor.runs_in_driver
    assert executor.results_folder(Path("out")) == tmp_path.resolve() / "out"


def test_work_bound_to_this_machine_runs_in_this_process(caplog: pytest.LogCaptureFixture):
    local = ClusterParams()
    assert in_this_process(local, "it copies files here") is local
    with caplog.at_level(logging.INFO, logger="eaglenest.core.executor"):
        moved = in_this_process(ClusterParams(executor="ray", workers=4), "it copies files here")
    assert (moved.executor, moved.workers) == ("local", 4)
    assert caplog.messages == ["it copies files here; cluster.executor: ray is not used"]


def test_an_actor_whose_engine_never_starts_is_dropped_and_then_the_stage_stops():
    executor = RayExecutor.__new__(RayExecutor)  # the dispatcher alone: no cluster is asked for nodes
    executor.cluster = ClusterParams(executor="ray", max_task_retries=2)
    first, second = actors = [_Actor(handle=None), _Actor(handle=None)]
    assert first.state is ActorState.STARTING
    executor._start_failed(first, actors, RuntimeError("no weights"))
    assert first.state is ActorState.DOWN
    executor._start_failed(first, actors, RuntimeError("no weights"))
    assert (first.state, second.state) == (ActorState.DROPPED, ActorState.STARTING)
    second.start_failures = 1
    with pytest.raises(
        EaglenestError,
        match=r"^no engine could start on the cluster; the last failure: "
        r"RuntimeError: no weights$",
    ):
        executor._start_failed(second, actors, RuntimeError("no weights"))
    assert second.state is ActorState.DROPPED


def test_without_ray_every_way_to_the_cluster_is_the_same_one_line(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # this interpreter as one without Ray
    cluster = ClusterParams(executor="ray", address="local")
    with pytest.raises(EaglenestError, match=NO_RAY):
        check_cluster(cluster)
    with pytest.raises(EaglenestError, match=NO_RAY):
        describe_cluster(cluster)
    with pytest.raises(EaglenestError, match=NO_RAY), connect(cluster):
        pass
    check_cluster(ClusterParams())  # the local executor needs no Ray


@dataclass(frozen=True)
class Numbered:
    """A task of the stream tests: its number, and a marker file whose absence kills the engine running it once."""

    number: int
    die_unless: str | None = None

    @property
    def label(self) -> str:
        return f"task {self.number}"


def engine_pid() -> int:
    return os.getpid()


def square_slowly(engine: int, task: Numbered) -> tuple[int, int]:
    """(the square, the engine process that computed it); the engine process kills itself on the task with a marker
    not yet written (the marker is written first, so the task's next try finishes)."""
    if task.die_unless is not None and not Path(task.die_unless).exists():
        Path(task.die_unless).touch()
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.05 * (task.number % 3))  # engines finish out of order
    return task.number**2, engine


def test_a_local_stream_hands_back_every_result_in_order_within_its_window_and_survives_a_killed_engine(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    taken: list[int] = []

    def plan():  # endless, and read lazily: the window bounds how far it is taken
        for number in itertools.count():
            taken.append(number)
            yield Numbered(number, str(tmp_path / "died") if number == 5 else None)

    executor = LocalExecutor(engines=2)
    results = []
    with caplog.at_level(logging.WARNING, logger="eaglenest.core.executor"):
        stream = executor.stream(engine_pid, square_slowly, plan(), window=3)
        for task, (square, pid) in stream:
            results.append((task.number, square, pid))
            assert len(taken) - len(results) <= 3  # never more than the window ahead of the consumer
            if len(results) == 12:
                break
        stream.close()
    assert [(n, s) for n, s, _ in results] == [(n, n * n) for n in range(12)]
    assert {pid for *_, pid in results} != {os.getpid()}  # computed by engine processes, not this one
    assert (tmp_path / "died").exists()  # the fault happened
    assert any("an engine process died" in message for message in caplog.messages)


def fail_always(engine: int, task: Numbered) -> int:
    raise RuntimeError(f"cannot compute {task.number}")


def refuse(engine: int, task: Numbered) -> int:
    raise EaglenestError(f"row {task.number} is bad")


def test_a_local_stream_stops_after_the_last_try_and_at_once_on_a_checked_error():
    executor = LocalExecutor(engines=1, max_task_retries=2)
    with pytest.raises(EaglenestError, match=r"^task 0 failed 2 times \(cluster.max_task_retries = 2\); the last: "):
        next(executor.stream(engine_pid, fail_always, [Numbered(0)], window=2))
    with pytest.raises(EaglenestError, match=r"^row 0 is bad$"):
        next(executor.stream(engine_pid, refuse, [Numbered(0)], window=2))


def write_pid(folder: str) -> int:
    """An engine that says where it runs: its pid, in ``folder``/engine.pid."""
    Path(folder, "engine.pid").write_text(str(os.getpid()))
    return os.getpid()


def nothing(engine: int, task: Numbered) -> int:
    return engine


KILLED_TRAINER = """
import functools, os, signal, sys
from eaglenest.core.executor import LocalExecutor
from tests.core.test_executor import Numbered, nothing, write_pid
stream = LocalExecutor(engines=1).stream(functools.partial(write_pid, sys.argv[1]), nothing, [Numbered(0)], window=1)
next(stream)
os.kill(os.getpid(), signal.SIGKILL)  # a trainer killed: nothing of it runs any more
"""


def test_engine_processes_die_with_the_process_that_streams_from_them(tmp_path: Path):
    """A trainer killed with SIGKILL cannot stop its engines: they die with it (a verifier's memory is not left
    held by an orphan)."""
    done = subprocess.run(
        [sys.executable, "-c", KILLED_TRAINER, str(tmp_path)], cwd=REPO, env=project_env(), timeout=120, check=False
    )
    assert done.returncode == -signal.SIGKILL
    engine = int((tmp_path / "engine.pid").read_text())
    assert wait_until_gone([engine], timeout_s=10) == [], "the engine process outlived the process it served"


def no_weights() -> int:
    raise FileNotFoundError("model.safetensors")


def test_a_local_stream_whose_engine_cannot_start_stops_after_the_last_try():
    stream = LocalExecutor(engines=1, max_task_retries=2).stream(no_weights, nothing, [Numbered(0)], window=1)
    with pytest.raises(
        EaglenestError, match=r"^task 0 failed 2 times .*its engine failed to start \(its log is above\)"
    ):
        next(stream)
