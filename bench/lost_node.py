"""Benchmark (run by hand): a node lost in the middle of a two-node training run, on this machine.

    .venv/bin/python bench/lost_node.py --tiny --out bench/results/lost_node.json
    .venv/bin/python bench/lost_node.py --inputs . --steps 60 --checkpoint-every 10   # after `dvc repro convert`

Two `eaglenest train-launch` "nodes" of one process each (cluster.torchrun: nodes 1:2, one process per node,
train.nproc 2) train in scratch checkouts over the inputs of --inputs (models/verifier, data/prepared,
data/hidden_states, data/vocab; --tiny builds the tests' tiny random verifier and 10 rows instead). Node a starts
first and hosts the rendezvous; once the first checkpoint is written, node b's launcher and its training process
are killed with SIGKILL. Node a's launcher restarts its process, the rendezvous closes without node b, and it
resumes alone from the checkpoint, accumulating both sequences of each step. Prints and writes the times, what
train_details.json says, and the largest weight difference against the same steps run uninterrupted by the stage
on 2 processes on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
INPUTS = {
    "models/verifier": "models/verifier",
    "data/prepared": "data/prepared",
    "data/hidden_states": "data/hidden_states",
    "data/vocab": "data/vocab",
}


def tiny_inputs(root: Path) -> Path:
    """The tests' tiny inputs (a random 8-layer verifier, 8 training rows of 24 tokens) in a checkout's layout."""
    sys.path.insert(0, str(REPO))
    from tests.fixtures.models import build_tiny_verifier
    from tests.fixtures.pipeline import equal_length_training_data

    equal_length_training_data(root, build_tiny_verifier(root / "tiny-verifier"))
    for link, made in zip(INPUTS, ("verifier", "prepared", "hs", "vocab"), strict=True):
        (root / link).parent.mkdir(exist_ok=True)
        (root / link).symlink_to(root / made)
    return root


def scratch_checkout(root: Path, inputs: Path, params: dict) -> Path:
    """dvc.yaml, the stage scripts and params.yaml at ``root``, the inputs linked from ``inputs``."""
    root.mkdir(parents=True)
    (root / "dvc.yaml").write_text((REPO / "dvc.yaml").read_text())
    (root / "stages").symlink_to(REPO / "stages")
    for link in INPUTS:
        (root / link).parent.mkdir(exist_ok=True)
        (root / link).symlink_to((inputs / link).resolve())
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return root


def process_tree(pid: int) -> list[int]:
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [pid] + [grandchild for child in children for grandchild in process_tree(int(child))]


def launch_node(root: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "eaglenest", "train-launch"], cwd=root, stdout=log.open("w"), stderr=subprocess.STDOUT
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", type=Path, default=Path("."), help="a checkout after `dvc repro convert`")
    parser.add_argument("--tiny", action="store_true", help="build the tests' tiny inputs instead of --inputs")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--scratch", type=Path, default=None, help="folder for the runs (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    args = parser.parse_args()
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="lost-node-"))
    inputs = tiny_inputs(scratch / "inputs") if args.tiny else args.inputs
    params = yaml.safe_load((inputs / "params.yaml").read_text()) if (inputs / "params.yaml").is_file() else {}
    params = {key: value for key, value in params.items() if key != "cluster"}
    params["train"] = {
        **params.get("train", {}),
        "steps": args.steps,
        "checkpoint_every": args.checkpoint_every,
        "eval_every": args.checkpoint_every * 2,
        "nproc": 2,
        "precision": "float32",
    }
    if args.tiny:
        params.update(
            extract={"dtype": "float32"}, train={**params["train"], "total_seq_len": 96, "lr": 3e-3, "warmup_steps": 0}
        )

    reference = scratch_checkout(scratch / "uninterrupted", inputs, params)
    started = time.perf_counter()
    stage = subprocess.run(
        [sys.executable, *yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["train"]["cmd"].split()[1:]],
        cwd=reference,
        capture_output=True,
        text=True,
    )
    assert stage.returncode == 0, stage.stderr
    uninterrupted_s = time.perf_counter() - started

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torchrun = {"min_nodes": 1, "max_nodes": 2, "nproc_per_node": 1, "rdzv_endpoint": f"127.0.0.1:{port}"}
    root = scratch_checkout(scratch / "two-nodes", inputs, {**params, "cluster": {"torchrun": torchrun}})
    started = time.perf_counter()
    node_a = launch_node(root, scratch / "node-a.log")
    time.sleep(3)  # node a hosts the rendezvous, as the first node of an allocation does
    node_b = launch_node(root, scratch / "node-b.log")
    checkpoints = root / ".eaglenest" / "train-checkpoints"
    while not any(checkpoints.rglob("checkpoint.pt")):
        assert node_a.poll() is None and node_b.poll() is None, "a node ended before the first checkpoint"
        time.sleep(0.05)
    killed = time.perf_counter()
    for pid in process_tree(node_b.pid):  # the launcher and its training process: the whole node
        os.kill(pid, signal.SIGKILL)
    node_a.wait()
    finished = time.perf_counter()
    details = json.loads((root / "metrics" / "train_details.json").read_text())
    ours = load_file(root / "models" / "draft" / "model.safetensors")
    theirs = load_file(reference / "models" / "draft" / "model.safetensors")
    figures = {
        "inputs": "tiny" if args.tiny else str(args.inputs.resolve()),
        "steps": args.steps,
        "checkpoint_every": args.checkpoint_every,
        "uninterrupted_2_processes_s": round(uninterrupted_s, 1),
        "node_b_killed_after_s": round(killed - started, 1),
        "node_a_exit": node_a.returncode,
        "node_a_finished_after_kill_s": round(finished - killed, 1),
        **{key: details[key] for key in ("processes", "launcher_restarts", "resumed_from_step")},
        "max_abs_weight_difference": max((ours[name] - theirs[name]).abs().max().item() for name in theirs),
    }
    print(json.dumps(figures, indent=2), f"\nthe nodes' logs: {scratch}")
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
