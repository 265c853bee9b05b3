"""The executor's offer to a stage, its dispatcher's actor states, and its refusals; a Ray cluster's own behaviour
is tested in tests/stages/extract/test_ray_executor.py."""

from __future__ import annotations

import logging
import sys
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
