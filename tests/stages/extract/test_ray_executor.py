"""Extraction on a real Ray cluster of three nodes on this machine (``cluster.executor: ray``): the same bytes as
the local executor, also when an engine's process is killed or its node removed mid-run, every shard written once;
a row the verifier cannot compute stops the stage in one line, and the rerun keeps the finished shards."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from eaglenest.artifacts.hidden_states.extract_params import ExtractParams
from eaglenest.artifacts.hidden_states.format import stored_files
from eaglenest.artifacts.hidden_states.resume import Extraction, unfinished_dir
from eaglenest.artifacts.prepared import write_prepared
from eaglenest.core.params import ClusterParams
from eaglenest.stages.extract import extract_hidden_states, job
from eaglenest.stages.verifier import build_verifier
from eaglenest.stages.verifier.params import VerifierParams
from tests.conftest import requires_vllm
from tests.fixtures.cluster import TokenHead, engine_processes, ray_free_env, wait_until_gone
from tests.fixtures.models import build_tiny_verifier
from tests.fixtures.pipeline import REPO, project_env, stored_row

ROWS, ROWS_PER_SHARD = 48, 2  # 24 shards, one task each (a shard is cut into tasks of ROWS_PER_TASK rows)
POISON = 299  # a token id whose embedding is NaN in the poisoned verifier


def folder(path: Path) -> dict[str, bytes]:
    return {file.name: file.read_bytes() for file in sorted(path.iterdir())}


def random_rows(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, POISON) for _ in range(rng.randrange(120, 240))] for _ in range(ROWS)]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A verifier wide enough that a task takes a while (8 layers of 256, heads of 32), 48 prepared rows of
    120-240 tokens, and the local executor's extraction of them: the reference."""
    root = tmp_path_factory.mktemp("ray-extract")
    model = build_tiny_verifier(root / "model", hidden_size=256, num_heads=8)
    build_verifier(VerifierParams(model=str(model), aux_layers=[1, 3, 5]), root / "verifier")
    rows = random_rows(0)
    write_prepared(root / "prepared", rows, [[0] * 20 + [1] * (len(r) - 20) for r in rows], 40, [])
    extract_hidden_states(
        ExtractParams(rows_per_shard=ROWS_PER_SHARD),
        root / "verifier",
        root / "prepared",
        root / "local",
        root / "local.json",
    )
    return {
        "root": root,
        "model": model,
        "verifier": root / "verifier",
        "prepared": root / "prepared",
        "local": root / "local",
    }


class Writes:
    """Counts, by name, the finished shards the driver writes (whole, or from the rows of their tasks, and the tasks
    whose rows it wrote), and those a worker wrote that the driver checks (spies on the one place each happens)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.names: Counter[str] = Counter()
        self.tasks: Counter[str] = Counter()
        self.checked: Counter[str] = Counter()
        accept_bytes, accept_rows, accept_file = Extraction.accept_bytes, Extraction.accept_rows, Extraction.accept_file

        def written(extraction: Extraction, spec: Any, data: Any) -> None:
            self.names[spec.name] += 1
            accept_bytes(extraction, spec, data)

        def rows_written(extraction: Extraction, spec: Any, rows: Any) -> bool:
            self.tasks[spec.name] += 1
            finished = accept_rows(extraction, spec, rows)
            self.names[spec.name] += finished
            return finished

        def checked(extraction: Extraction, spec: Any) -> None:
            self.checked[spec.name] += 1
            accept_file(extraction, spec)

        monkeypatch.setattr(Extraction, "accept_bytes", written)
        monkeypatch.setattr(Extraction, "accept_rows", rows_written)
        monkeypatch.setattr(Extraction, "accept_file", checked)


class EngineWatcher(logging.Handler):
    """Collects the executor's log: which engines are ready (node and pid), and which tasks lost theirs."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.ready: list[tuple[str, int]] = []
        self.lost: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "ready (node" in message:
            node, pid = message.split("(node ")[1].rstrip(")").split(", pid ")
            self.ready.append((node, int(pid)))
        if "was lost" in message:
            self.lost.append(message)


def disrupt_mid_run(out: Path, watcher: EngineWatcher, act) -> threading.Thread:
    """A thread that, once a shard is finished and an engine is up (so tasks are in flight and more are queued),
    calls ``act(node, pid)`` on the first engine that came up."""

    def run() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if watcher.ready and len(stored_files(unfinished_dir(out))) >= 1:
                act(*watcher.ready[0])
                return
            time.sleep(0.005)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def run_on_ray(data: dict[str, Path], out: Path, cluster: Any, watcher: EngineWatcher, act) -> dict[str, Any]:
    logger = logging.getLogger("eaglenest.core.executor")
    logger.addHandler(watcher)
    logger.setLevel(logging.INFO)
    thread = disrupt_mid_run(out, watcher, act)
    try:
        metrics = extract_hidden_states(
            ExtractParams(rows_per_shard=ROWS_PER_SHARD),
            data["verifier"],
            data["prepared"],
            out,
            out.with_suffix(".json"),
            ClusterParams(executor="ray", address=cluster.address),
        )
    finally:
        logger.removeHandler(watcher)
        thread.join(timeout=60)
    assert wait_until_gone(engine_processes()) == [], "the executor's actors outlived the stage"
    return metrics


@pytest.mark.slow  # a Ray cluster of 3 nodes (tests/fixtures/cluster.py) and engines that load a model
def test_a_killed_engine_process_loses_nothing(
    data: dict[str, Path], ray_cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    writes, watcher, killed = Writes(monkeypatch), EngineWatcher(), []

    def kill(node: str, pid: int) -> None:
        killed.append(len(stored_files(unfinished_dir(tmp_path / "hs"))))
        os.kill(pid, signal.SIGKILL)

    metrics = run_on_ray(data, tmp_path / "hs", ray_cluster, watcher, kill)
    assert killed and killed[0] < ROWS // ROWS_PER_SHARD  # killed mid-run
    assert watcher.lost, "no task was in flight on the killed engine"  # and its task ran again elsewhere
    assert (metrics["executor"], metrics["engines"], metrics["rows_computed"]) == ("ray", 3, ROWS)
    assert folder(tmp_path / "hs") == folder(data["local"])  # the local executor's bytes
    assert sorted(writes.names) == sorted(folder(data["local"])) and set(writes.names.values()) == {1}


@pytest.mark.slow  # a Ray cluster of 3 nodes (tests/fixtures/cluster.py) and engines that load a model
def test_a_removed_node_loses_nothing(
    data: dict[str, Path], ray_cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    writes, watcher, removed = Writes(monkeypatch), EngineWatcher(), []

    def remove(node: str, pid: int) -> None:
        victim = next(n for n in ray_cluster.worker_nodes if n.node_id.startswith(node))
        removed.append(len(stored_files(unfinished_dir(tmp_path / "hs"))))
        ray_cluster.remove_node(victim, allow_graceful=False)

    try:
        metrics = run_on_ray(data, tmp_path / "hs", ray_cluster, watcher, remove)
    finally:
        ray_cluster.add_node(num_cpus=1)  # three nodes again for the tests after this one
        ray_cluster.wait_for_nodes()
    assert removed and removed[0] < ROWS // ROWS_PER_SHARD and watcher.lost
    assert metrics["rows_computed"] == ROWS and folder(tmp_path / "hs") == folder(data["local"])
    assert sorted(writes.names) == sorted(folder(data["local"])) and set(writes.names.values()) == {1}


@pytest.mark.slow  # a Ray cluster of 3 nodes (tests/fixtures/cluster.py) and engines that load a model
def test_workers_write_their_shards_themselves_with_output_shared(
    data: dict[str, Path], ray_cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """cluster.output: shared: each worker writes its shards into the unfinished folder (a filesystem the nodes share:
    this machine's), and the driver only checks them; the bytes are the local executor's."""
    writes = Writes(monkeypatch)
    extract_hidden_states(
        ExtractParams(rows_per_shard=ROWS_PER_SHARD),
        data["verifier"],
        data["prepared"],
        tmp_path / "hs",
        tmp_path / "m.json",
        ClusterParams(executor="ray", address=ray_cluster.address, output="shared", workers=2),
    )
    assert folder(tmp_path / "hs") == folder(data["local"])
    assert not writes.names and sorted(writes.checked) == sorted(folder(data["local"]))
    assert set(writes.checked.values()) == {1} and wait_until_gone(engine_processes()) == []


@pytest.mark.slow  # a Ray cluster of 3 nodes (tests/fixtures/cluster.py) and engines that load a model
def test_shards_cut_into_tasks_on_ray_are_the_bytes_of_whole_shard_tasks(
    data: dict[str, Path], ray_cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Shards of 16 rows cut into tasks of at least 4 rows (whole batches of 2 or 3 rows), spread over 3 engines: the
    bytes of the local executor computing each shard in one task; each shard written once, from several tasks."""
    params = ExtractParams(rows_per_shard=16, batch_tokens=480)
    monkeypatch.setattr(job, "ROWS_PER_TASK", 10**6)
    extract_hidden_states(params, data["verifier"], data["prepared"], tmp_path / "local", tmp_path / "local.json")
    monkeypatch.setattr(job, "ROWS_PER_TASK", 4)
    writes = Writes(monkeypatch)
    metrics = extract_hidden_states(
        params,
        data["verifier"],
        data["prepared"],
        tmp_path / "hs",
        tmp_path / "m.json",
        ClusterParams(executor="ray", address=ray_cluster.address),
    )
    assert (metrics["engines"], metrics["rows_computed"]) == (3, ROWS)
    assert folder(tmp_path / "hs") == folder(tmp_path / "local")
    assert writes.names == dict.fromkeys(folder(tmp_path / "local"), 1) and min(writes.tasks.values()) >= 2
    assert wait_until_gone(engine_processes()) == []


def poison_embedding(model: Path, dest: Path) -> Path:
    """The verifier with token POISON's embedding NaN: every row holding it yields non-finite hidden states."""
    import shutil

    shutil.copytree(model, dest)
    weights = load_file(dest / "model.safetensors")
    weights["model.embed_tokens.weight"][POISON] = float("nan")
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def stage(root: Path, params: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    return subprocess.run(
        [
            sys.executable,
            str(REPO / "stages" / "extract.py"),
            "--params",
            "params.yaml",
            "--verifier",
            "verifier",
            "--prepared",
            "prepared",
            "--out",
            "hs",
            "--metrics",
            "m.json",
        ],
        cwd=root,
        env=project_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow  # a Ray cluster of 3 nodes (tests/fixtures/cluster.py) and engines that load a model
def test_a_poisoned_row_stops_the_stage_in_one_line_and_the_rerun_keeps_finished_shards(
    data: dict[str, Path], ray_cluster: Any, tmp_path: Path
):
    model = poison_embedding(data["model"], tmp_path / "model")
    build_verifier(VerifierParams(model=str(model), aux_layers=[1, 3, 5]), tmp_path / "verifier")
    rows = random_rows(0)
    rows[37][5] = POISON  # row 37: shard 18
    masks = [[0] * 20 + [1] * (len(r) - 20) for r in rows]
    write_prepared(tmp_path / "prepared", rows, masks, 40, [])
    # one engine is enough here: the stage stops at the shard, whichever engine computes it
    cluster = {"executor": "ray", "address": ray_cluster.address, "workers": 1}
    failed = stage(tmp_path, {"extract": {"rows_per_shard": ROWS_PER_SHARD}, "cluster": cluster})
    assert failed.returncode == 2, failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr
    assert (
        failed.stderr.strip()
        .splitlines()[-1]
        .startswith("eaglenest extract: error: shard 18 (rows 36..37): row 37: the verifier computed ")
    )
    # a NaN key poisons the attention scores of every query (masked positions included): from token 0 on
    assert "non-finite hidden-state values (first at token 0, slot 0); check the row's tokens" in failed.stderr
    finished = {path.name: path.stat().st_ino for path in stored_files(unfinished_dir(tmp_path / "hs"))}
    assert "shard_18.safetensors" not in finished and not list((tmp_path / "hs").iterdir())

    rows[37][5] = 7  # the fix: the row's token
    write_prepared(tmp_path / "prepared", rows, masks, 40, [])
    metrics = extract_hidden_states(
        ExtractParams(rows_per_shard=ROWS_PER_SHARD),
        tmp_path / "verifier",
        tmp_path / "prepared",
        tmp_path / "hs",
        tmp_path / "m.json",
        ClusterParams(**cluster),
    )
    assert metrics["rows_reused"] == ROWS_PER_SHARD * len(finished)  # finished shards are not computed again
    for name, inode in finished.items():
        assert (tmp_path / "hs" / name).stat().st_ino == inode, name  # the very file, moved in
    assert not unfinished_dir(tmp_path / "hs").exists()
    assert wait_until_gone(engine_processes()) == []
    local = extract_hidden_states(
        ExtractParams(rows_per_shard=ROWS_PER_SHARD),
        tmp_path / "verifier",
        tmp_path / "prepared",
        tmp_path / "local",
        tmp_path / "local.json",
    )
    assert local["rows_computed"] == ROWS and folder(tmp_path / "hs") == folder(tmp_path / "local")


def test_stage_script_without_a_cluster_at_the_address_is_one_line(tmp_path: Path, data: dict[str, Path]):
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name in ("verifier", "prepared"):
        os.symlink(data[name], tmp_path / name)
    result = stage(tmp_path, {"cluster": {"executor": "ray", "address": f"127.0.0.1:{port}"}})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(f"eaglenest extract: error: cluster.address = '127.0.0.1:{port}': no Ray cluster answers there (")
    )
    assert "ray start --head --port=6379" in result.stderr and not (tmp_path / "hs").exists()


@pytest.mark.slow  # a Ray cluster of 3 nodes (tests/fixtures/cluster.py) and engines that load a model
def test_an_engine_wider_than_every_node_is_refused_before_any_work(
    data: dict[str, Path], ray_cluster: Any, tmp_path: Path
):
    """The test cluster has no GPUs, so a CPU engine that asks more CPUs than any node has shows the rule: one line
    naming the key, before an actor starts."""
    from eaglenest.core.errors import EaglenestError

    with pytest.raises(
        EaglenestError,
        match=r"^cluster.cpus_per_worker = 2: no node of the Ray cluster has that "
        r"many CPUs \(the largest has 1, in 4 nodes alive\); lower it or add",
    ):
        extract_hidden_states(
            ExtractParams(rows_per_shard=ROWS_PER_SHARD),
            data["verifier"],
            data["prepared"],
            tmp_path / "hs",
            tmp_path / "m.json",
            ClusterParams(executor="ray", address=ray_cluster.address, cpus_per_worker=2),
        )
    assert engine_processes() == [] and not list(stored_files(unfinished_dir(tmp_path / "hs")))


@pytest.mark.slow  # the module's Ray cluster of 3 nodes (tests/fixtures/cluster.py); no engine starts
def test_ray_engines_run_outside_the_driver_and_write_only_into_a_shared_folder(ray_cluster: Any, tmp_path: Path):
    """What a stage asks of the Ray executor: its engines never share the driver's process, and tasks write into
    the stage's folder only with cluster.output: shared (else results travel back to the driver)."""
    from eaglenest.core.executor import EngineNeeds, RayExecutor, connect

    driver = ClusterParams(executor="ray", address=ray_cluster.address)
    with connect(driver):
        executor = RayExecutor(driver, EngineNeeds(None))
        shared = RayExecutor(driver.model_copy(update={"output": "shared"}), EngineNeeds(None))
    assert not executor.runs_in_driver and not shared.runs_in_driver
    assert (executor.results_folder(tmp_path), shared.results_folder(tmp_path)) == (None, tmp_path.resolve())


def test_a_gpu_engine_wider_than_every_node_is_refused():
    from eaglenest.core.errors import EaglenestError
    from eaglenest.core.executor import EngineNeeds, plan_engines

    nodes = [{"CPU": 64.0, "GPU": 8.0}, {"CPU": 64.0, "GPU": 4.0}, {"CPU": 8.0}]
    wide = EngineNeeds(4, "extract.vllm.tensor_parallel_size")
    options, workers, _ = plan_engines(ClusterParams(executor="ray"), wide, nodes)
    assert workers == 3 and options == {"placement_bundles": [{"GPU": 1, "CPU": 1}] * 4}
    assert plan_engines(ClusterParams(executor="ray"), EngineNeeds(1), nodes)[:2] == (
        {"num_gpus": 1, "num_cpus": 1},
        12,
    )
    with pytest.raises(
        EaglenestError,
        match=r"^extract.vllm.tensor_parallel_size = 16: an engine needs 16 GPUs on one "
        r"node, and the largest node of the Ray cluster has 8; lower",
    ):
        plan_engines(ClusterParams(executor="ray"), EngineNeeds(16, "extract.vllm.tensor_parallel_size"), nodes)
    assert plan_engines(ClusterParams(executor="ray", workers=2), EngineNeeds(None), nodes)[1] == 2


def test_rows_of_a_shard_come_back_as_the_file_a_worker_would_write(data: dict[str, Path]):
    """The two sinks of a task (a buffer for the driver, a file for cluster.output: shared) give the same bytes."""
    from eaglenest.artifacts.hidden_states.engines import make_engine
    from eaglenest.artifacts.hidden_states.engines.contract import EngineSettings
    from eaglenest.stages.extract import ExtractionPlan, plan_extraction
    from eaglenest.stages.extract.job import ExtractTask, run_extract_task

    plan: ExtractionPlan = plan_extraction(
        ExtractParams(rows_per_shard=ROWS_PER_SHARD), data["verifier"], data["prepared"], data["root"] / "sinks"
    )
    layouts = (plan.layout(plan.todo[5]),)
    engine = make_engine(EngineSettings(plan.verifier, plan.model_dir, plan.params, 240))
    ((_, buffer),) = run_extract_task(engine, ExtractTask(layouts, "bfloat16", None))
    destination = data["root"] / "written"
    ((_, path),) = run_extract_task(engine, ExtractTask(layouts, "bfloat16", destination))
    assert bytes(buffer) == path.read_bytes() == (data["local"] / path.name).read_bytes()
    mtime = path.stat().st_mtime_ns
    run_extract_task(engine, ExtractTask(layouts, "bfloat16", destination))  # run again after its worker died
    assert path.stat().st_mtime_ns == mtime and torch.equal(
        load_file(path)["token_ids"], load_file(data["local"] / path.name)["token_ids"]
    )


@pytest.mark.slow
@requires_vllm
def test_vllm_engines_in_ray_actors_match_hf(data: dict[str, Path], ray_cluster: Any, tmp_path: Path):
    """extract.backend: vllm in an actor (vLLM's CPU build here), float32: equal to the hf reference within the
    bound the back ends are held to (tests/stages/extract/test_vllm_extract_real.py)."""
    from tests.stages.extract.test_vllm_extract_real import FP32_BOUND, relative_errors

    hf = extract_hidden_states(
        ExtractParams(rows_per_shard=ROWS_PER_SHARD, dtype="float32"),
        data["verifier"],
        data["prepared"],
        tmp_path / "hf",
        tmp_path / "hf.json",
    )
    params = ExtractParams(backend="vllm", dtype="float32", vllm={"dtype": "float32"}, rows_per_shard=ROWS_PER_SHARD)
    metrics = extract_hidden_states(
        params,
        data["verifier"],
        data["prepared"],
        tmp_path / "vllm",
        tmp_path / "vllm.json",
        ClusterParams(executor="ray", address=ray_cluster.address, workers=1),
    )
    assert (metrics["executor"], metrics["engines"], metrics["rows_computed"]) == ("ray", 1, hf["rows"])
    got = [stored_row(tmp_path / "vllm", row) for row in range(ROWS)]
    want = [stored_row(tmp_path / "hf", row) for row in range(ROWS)]
    assert all(torch.equal(a["token_ids"], b["token_ids"]) for a, b in zip(got, want, strict=True))
    errors = relative_errors(got, want)
    assert max(errors) < FP32_BOUND, errors
    assert wait_until_gone(engine_processes()) == []


@pytest.mark.slow  # a Ray cluster of 3 nodes (tests/fixtures/cluster.py) and engines that load a model
def test_doctor_reports_the_cluster_or_why_it_cannot_reach_it(
    ray_cluster: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    from eaglenest.commands.cli import main as cli_main

    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"cluster": {"executor": "ray", "address": ray_cluster.address}}))
    assert cli_main(["doctor", "--params", str(params)]) == 0
    assert f"cluster: executor ray at {ray_cluster.address}: 4 nodes alive, 3 CPUs, 0 GPUs" in capsys.readouterr().out
    params.write_text(yaml.safe_dump({"cluster": {"executor": "ray", "address": "127.0.0.1:9"}}))
    assert cli_main(["doctor", "--params", str(params)]) == 1
    assert capsys.readouterr().err.startswith("error: cluster.address = '127.0.0.1:9': no Ray cluster answers there")


def test_a_cluster_named_by_address_gets_the_token_the_user_has(token_head: TokenHead):
    """Ray sends its token to a host:port only in token mode, which it does not switch on by itself there: connect
    asks for it where the user has a token (here RAY_AUTH_TOKEN_PATH, as scripts/cluster/ray_token.sh exports it)."""
    code = (
        "from eaglenest.core.executor import connect; from eaglenest.core.params import ClusterParams\n"
        f"with connect(ClusterParams(executor='ray', address={token_head.address!r})):\n"
        "    import ray; print('nodes:', len(ray.nodes()))"
    )  # Ray imported by connect, as the stages do
    env = ray_free_env(token_head.home) | {
        "RAY_AUTH_TOKEN_PATH": token_head.token_env["RAY_AUTH_TOKEN_PATH"],
        "PYTHONPATH": str(REPO / "src"),
    }
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "nodes: 1", done.stderr[-2000:]
