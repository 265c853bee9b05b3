"""Several nodes, one data set: torchrun's rendezvous joins training processes started as separate nodes. (Extraction
over several nodes runs on a Ray cluster: tests/stages/extract/test_ray_executor.py.)"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.fixtures.pipeline import REPO, equal_length_training_data, project_env


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_joined_by_torchrun_rendezvous_train_as_one_process(tmp_path: Path, tiny_verifier_dir: Path):
    """Two torchrun launches of 1 process each (--nnodes 2, c10d rendezvous), as on two machines, against the
    stage run in one process on the same global batch: same losses and weights."""
    equal_length_training_data(tmp_path, tiny_verifier_dir)
    paths = ["--verifier", str(tmp_path / "verifier"), "--prepared", str(tmp_path / "prepared"),
             "--hidden-states", str(tmp_path / "hs"), "--vocab", str(tmp_path / "vocab"), "--out", "draft",
             "--metrics", "train.json", "--details", "train_details.json", "--live-dir", "dvclive"]
    # float32: bf16 rounds differently for different batch shapes, and this checks the arithmetic is the same.
    train = {"steps": 3, "eval_every": 3, "lr": 3e-3, "warmup_steps": 0, "precision": "float32"}
    one, two = tmp_path / "one", tmp_path / "two"
    for run, seq_len in ((one, 192), (two, 96)):
        run.mkdir()
        (run / "params.yaml").write_text(yaml.safe_dump({"train": {**train, "total_seq_len": seq_len},
                                                         "extract": {"dtype": "float32"}}))
    stage = str(REPO / "stages" / "train.py")
    result = subprocess.run([sys.executable, stage, "--params", "params.yaml", *paths], cwd=one, env=project_env(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
                               "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                               "--rdzv-id=eaglenest-test", stage, "--params", "params.yaml", *paths],
                              cwd=two, env=project_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node in (0, 1)]
    for node in nodes:
        output, _ = node.communicate(timeout=600)
        assert node.returncode == 0, output
    assert json.loads((two / "train_details.json").read_text())["processes"] == 2
    for name in ("loss",):
        a = (one / f"dvclive/plots/metrics/train/{name}.tsv").read_text().splitlines()[1:]
        b = (two / f"dvclive/plots/metrics/train/{name}.tsv").read_text().splitlines()[1:]
        assert len(a) == len(b) == 3
        for x, y in zip(a, b, strict=True):
            assert float(x.split("\t")[1]) == pytest.approx(float(y.split("\t")[1]), rel=1e-4)
    a, b = load_file(one / "draft/model.safetensors"), load_file(two / "draft/model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)
