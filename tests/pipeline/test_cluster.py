"""`dvc repro` with ``cluster.executor: ray``: the executor is no stage's param, and extraction on a Ray cluster that
the stage starts on this machine gives the local executor's ``data/hidden_states`` (the same md5 in dvc.lock), also
when an engine's process is killed mid-run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from eaglenest.artifacts.hidden_states.format import stored_files
from eaglenest.artifacts.hidden_states.resume import unfinished_dir
from tests.fixtures.cluster import command_line, descendants, listening_beyond_loopback, wait_until_gone
from tests.fixtures.models import build_tiny_verifier, write_jsonl
from tests.fixtures.pipeline import VENV_BIN, dvc, make_pipeline_repo, project_env


def hidden_states_md5(repo: Path) -> str:
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    return next(out["md5"] for out in lock["stages"]["extract"]["outs"] if out["path"] == "data/hidden_states")


@pytest.mark.slow
def test_dvc_repro_on_a_ray_cluster_gives_the_local_executors_hidden_states(tmp_path: Path):
    model = build_tiny_verifier(tmp_path / "model", hidden_size=256, num_heads=8)  # a task takes a while
    repo = make_pipeline_repo(
        tmp_path / "repo",
        {
            "verifier": {"model": str(model), "aux_layers": [1, 3, 5]},
            "prepare": {"source": ["data/conversations/chats.jsonl"], "max_conversations": None, "regenerate": False},
            "extract": {"rows_per_shard": 2},
        },
    )
    chats = [
        {
            "conversations": [
                {"from": "human", "value": f"hello there {i}"},
                {"from": "gpt", "value": "the weather is nice, let us go for a walk " * (8 + i % 5)},
            ]
        }
        for i in range(40)
    ]
    write_jsonl(repo / "data/conversations/chats.jsonl", chats)
    dvc(["repro", "extract"], repo)  # the local executor: the reference
    local = hidden_states_md5(repo)

    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["cluster"]["executor"] = "ray"  # address: local, a cluster of this machine's CPUs started by the stage
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    status = dvc(["status", "extract"], repo)
    assert "changed" not in status.stdout, status.stdout  # where the work runs is no stage's param

    hs_dir = repo / "data/hidden_states"
    shutil.rmtree(hs_dir)
    log = tmp_path / "repro.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [str(VENV_BIN / "dvc"), "repro", "-f", "-s", "extract"],
            cwd=repo,
            env=project_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    killed, listening, running = [], [], set()
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and process.poll() is None and not killed:
            # the process tree is read (every process's /proc entry) only once a shard is finished: reading it every
            # 10 ms from the start takes a core's share from the stage on a small machine
            finished = stored_files(unfinished_dir(hs_dir))
            engines = (
                [pid for pid in descendants(process.pid) if command_line(pid).startswith("ray::EngineHost")]
                if finished
                else []
            )
            if engines:  # an engine computing, shards still to go
                running = descendants(process.pid)  # dvc, the stage, Ray's servers and workers
                listening = listening_beyond_loopback(running)
                os.kill(engines[0], signal.SIGKILL)
                killed.append(len(stored_files(unfinished_dir(hs_dir))))
            time.sleep(0.01)
        assert process.wait(timeout=600) == 0, log.read_text()[-3000:]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert killed and killed[0] < 20, log.read_text()[-3000:]  # killed mid-run (20 shards in all)
    assert listening == []  # the stage's own Ray cluster listens on 127.0.0.1 only
    assert len(running) > 5 and wait_until_gone(list(running)) == []  # no Ray process outlives the stage
    metrics = json.loads((repo / "metrics/extract.json").read_text())
    assert (metrics["executor"], metrics["engines"], metrics["rows_computed"]) == ("ray", 2, 40)
    assert hidden_states_md5(repo) == local and not unfinished_dir(hs_dir).exists()
