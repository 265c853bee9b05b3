"""train on several processes under torchrun's elastic launcher: a killed worker is restarted and the run resumes
from rank 0's checkpoint with the weights and curves of an uninterrupted run; the global batch (train.nproc)
trains the same steps on any number of processes, so a run that lost a node resumes on the rest; nodes started
by `eaglenest train-launch` join by rendezvous; the launch line it prints and the Slurm script that runs it."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from eaglenest.artifacts.hidden_states.extract_params import ExtractParams
from eaglenest.commands.cli import main
from eaglenest.commands.params_file import parse_params
from eaglenest.core.errors import ParamsError
from eaglenest.stages.extract import extract_hidden_states
from eaglenest.stages.train import TrainPaths, train_draft
from eaglenest.stages.train.checkpoint import CHECKPOINT_ROOT
from eaglenest.stages.train.params import TrainParams
from tests.fixtures.pipeline import (
    REPO,
    equal_length_training_data,
    project_env,
    read_curves,
    run_train_stage,
    stage_wrapper,
)

# The tiny data's 8 training rows of 24 tokens make 2 sequences of 96 per epoch: the global batch of 2 is every
# row, as one sequence of 192 is. float32: bf16 rounds differently for different batch shapes, and these tests
# check that the arithmetic is the same.
TRAIN = {
    "steps": 6,
    "eval_every": 3,
    "checkpoint_every": 3,
    "total_seq_len": 96,
    "lr": 3e-3,
    "warmup_steps": 0,
    "nproc": 2,
    "precision": "float32",
}
ALGORITHMS = {"eagle3": {}, "peagle": {"algorithm": "peagle"}, "dflash": {"algorithm": "dflash"}}

# The stage, of which the process of rank {rank} is killed with SIGKILL as it starts the first step after the
# step-3 checkpoint, on the launcher's first attempt only: a worker lost mid-run.
KILL_AFTER_CHECKPOINT = stage_wrapper(
    """\
import signal

import eaglenest.stages.train as train

seed = train.seed_torch


def seed_or_die(*labels):
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
    if labels[1:3] == ("train", 3) and os.environ.get("RANK") == "{rank}" and first_attempt:
        os.kill(os.getpid(), signal.SIGKILL)
    seed(*labels)


train.seed_torch = seed_or_die
# The stage runs the launcher on itself: every process runs this wrapper around it.
launch = train.run_launcher
train.run_launcher = lambda plan, script, argv: launch(plan, __file__, [script, *argv])
"""
)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, tiny_verifier_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("elastic")
    equal_length_training_data(root, tiny_verifier_dir)
    return root


@pytest.fixture(scope="module")
def uninterrupted(data: Path) -> Callable[[str], Path]:
    """algorithm -> the folder of an uninterrupted run of the stage on 2 processes (train.nproc: 2), made once."""
    runs: dict[str, Path] = {}

    def run(algorithm: str) -> Path:
        if algorithm not in runs:
            folder = data / f"uninterrupted-{algorithm}"
            result = run_train_stage(folder, data, {**TRAIN, **ALGORITHMS[algorithm]})
            assert result.returncode == 0, result.stdout + result.stderr
            runs[algorithm] = folder
        return runs[algorithm]

    return run


@pytest.fixture(scope="module")
def streamed(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same rows, vocabulary and verifier as ``data``, with ``extract.store: stream``'s manifest for hs."""
    root = tmp_path_factory.mktemp("elastic-stream")
    for name in ("verifier", "prepared", "vocab"):
        (root / name).symlink_to(data / name)
    params = ExtractParams(store="stream", dtype="float32")
    extract_hidden_states(params, root / "verifier", root / "prepared", root / "hs", root / "extract.json")
    return root


def assert_same_training(
    run: Path, reference: Path, live: str = "dvclive", draft: str = "draft", exact: bool = False
) -> None:
    """The same draft (within 1e-4) and every curve as the reference's; ``exact``: bit for bit, every value of
    every curve as written (the same number of processes, so the same arithmetic)."""
    a, b = load_file(run / draft / "model.safetensors"), load_file(reference / "draft" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0 if exact else 1e-4, atol=0 if exact else 1e-5)
    ours, theirs = read_curves(run / live), read_curves(reference / "dvclive")
    assert ours.keys() == theirs.keys() and ours["train/tokens_per_s"] == list(range(1, 7))
    if exact:
        assert ours == theirs
    for name, rows in theirs.items():
        if name == "summary" or name == "train/tokens_per_s":
            continue
        assert [step for step, _ in ours[name]] == [step for step, _ in rows], name
        assert [float(v) for _, v in ours[name]] == pytest.approx([float(v) for _, v in rows], rel=1e-4), name


def stage_paths(run: Path, data: Path) -> TrainPaths:
    """The stage's paths as run_train_stage gives them, for the stage's code run in this process."""
    return TrainPaths(
        verifier=data / "verifier",
        prepared=data / "prepared",
        hidden_states=data / "hs",
        vocab=data / "vocab",
        out=run / "draft",
        metrics=run / "train.json",
        details=run / "train_details.json",
        live_dir=run / "dvclive",
        checkpoints=run / CHECKPOINT_ROOT,
    )


@pytest.mark.slow
@pytest.mark.parametrize(("algorithm", "rank"), [("eagle3", 1), ("peagle", 0)])
def test_a_killed_worker_is_restarted_and_resumes_from_the_checkpoint(
    data: Path, uninterrupted, tmp_path: Path, algorithm: str, rank: int
):
    """SIGKILL of one of 2 processes after the step-3 checkpoint: the launcher restarts both, they resume at step
    3, and the draft and the curves are the uninterrupted run's (P-EAGLE samples positions at random: the resumed
    run draws what the uninterrupted one drew)."""
    wrapper = tmp_path / "kill_after_checkpoint.py"
    wrapper.write_text(KILL_AFTER_CHECKPOINT.format(rank=rank))
    result = run_train_stage(tmp_path, data, {**TRAIN, **ALGORITHMS[algorithm]}, script=wrapper)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"local_rank: {rank}" in result.stderr and "exitcode: -9" in result.stderr  # the launcher saw the kill
    details = json.loads((tmp_path / "train_details.json").read_text())
    assert (details["processes"], details["launcher_restarts"], details["resumed_from_step"]) == (2, 1, 3)
    assert_same_training(tmp_path, uninterrupted(algorithm), exact=True)
    assert json.loads((tmp_path / "draft/config.json").read_text())["speculators_model_type"] == algorithm
    assert not any((tmp_path / CHECKPOINT_ROOT).rglob("checkpoint.pt"))  # finished: the checkpoint is gone


@pytest.mark.slow
def test_a_run_that_lost_a_node_resumes_on_the_rest(data: Path, uninterrupted, tmp_path: Path):
    """With no restart left (cluster.torchrun.max_restarts: 0) a lost process ends the run in one line; the rest of
    the global batch resumes from rank 0's checkpoint in one process, which accumulates both sequences of each
    step: DFlash's random blocks and every weight are the 2-process run's."""
    wrapper = tmp_path / "kill_after_checkpoint.py"
    wrapper.write_text(KILL_AFTER_CHECKPOINT.format(rank=1))
    train = {**TRAIN, **ALGORITHMS["dflash"]}
    died = run_train_stage(tmp_path, data, train, script=wrapper, cluster={"torchrun": {"max_restarts": 0}})
    assert died.returncode == 2 and not (tmp_path / "draft").exists()
    assert died.stderr.strip().splitlines()[-1] == (
        "eaglenest train: error: training process rank 1 was killed by SIGKILL and the launcher has no restart left "
        "(cluster.torchrun.max_restarts = 0); its own output is above; a rerun resumes from the last checkpoint"
    )
    resumed = train_draft(TrainParams(**train), stage_paths(tmp_path, data))  # one process: world size 1
    assert (resumed["processes"], resumed["resumed_from_step"]) == (1, 3)
    assert_same_training(tmp_path, uninterrupted("dflash"))


@pytest.mark.slow
def test_one_process_trains_the_global_batch_of_two(data: Path, uninterrupted, tmp_path: Path):
    """train.nproc is the global batch: one process accumulating its 2 sequences a step, and one process
    training all 8 rows as a single sequence of 192, train what 2 processes do."""
    accumulated = train_draft(TrainParams(**TRAIN), stage_paths(tmp_path / "accumulated", data))
    assert accumulated["processes"] == 1
    assert_same_training(tmp_path / "accumulated", uninterrupted("eagle3"))
    one = train_draft(TrainParams(**{**TRAIN, "nproc": 1, "total_seq_len": 192}), stage_paths(tmp_path / "one", data))
    two = json.loads((uninterrupted("eagle3") / "train_details.json").read_text())
    assert one["train_loss"] == pytest.approx(two["train_loss"], rel=1e-4)
    assert_same_training(tmp_path / "one", uninterrupted("eagle3"))


@pytest.mark.slow
def test_muon_on_two_processes_restarted_after_a_kill_trains_what_one_process_does(data: Path, tmp_path: Path):
    """train.optimizer: muon under DDP: Muon orthogonalizes the gradients DDP averaged, the same on every process;
    a worker killed after the step-3 checkpoint is restarted and both resume Muon's momentum and AdamW's moments:
    the draft and curves of one process accumulating the same global batch."""
    train = {**TRAIN, "optimizer": "muon"}
    wrapper = tmp_path / "kill_after_checkpoint.py"
    wrapper.write_text(KILL_AFTER_CHECKPOINT.format(rank=1))
    result = run_train_stage(tmp_path / "two", data, train, script=wrapper)
    assert result.returncode == 0, result.stdout + result.stderr
    details = json.loads((tmp_path / "two/train_details.json").read_text())
    assert (details["processes"], details["launcher_restarts"], details["resumed_from_step"]) == (2, 1, 3)
    one = train_draft(TrainParams(**train), stage_paths(tmp_path / "one", data))
    assert (one["processes"], one["optimizer"]) == (1, "muon")
    assert_same_training(tmp_path / "two", tmp_path / "one")
    assert "train/muon_lr" in read_curves(tmp_path / "two/dvclive")


def checkout(root: Path, data: Path, params: dict) -> Path:
    """A checkout's layout at ``root`` over the tiny data, with ``params`` as its params.yaml: dvc.yaml and the
    stage scripts of this repository, the stage's inputs where dvc.yaml names them."""
    root.mkdir(parents=True)
    (root / "dvc.yaml").write_text((REPO / "dvc.yaml").read_text())
    (root / "stages").symlink_to(REPO / "stages")
    for link, target in (
        ("models/verifier", "verifier"),
        ("data/prepared", "prepared"),
        ("data/hidden_states", "hs"),
        ("data/vocab", "vocab"),
    ):
        (root / link).parent.mkdir(exist_ok=True)
        (root / link).symlink_to(data / target)
    (root / "params.yaml").write_text(yaml.safe_dump({"extract": {"dtype": "float32"}, **params}))
    return root


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_nodes(checkouts: list[Path]) -> list[str]:
    """`eaglenest train-launch` in each checkout at once, as on one node each; their output."""
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "eaglenest", "train-launch"],
            cwd=root,
            env=project_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for root in checkouts
    ]
    return [node.communicate(timeout=600)[0] + f"\nexit {node.returncode}" for node in nodes]


@pytest.mark.slow
def test_two_nodes_joined_by_the_rendezvous_train_as_two_processes(data: Path, uninterrupted, tmp_path: Path):
    """Two `eaglenest train-launch` of 1 process each (cluster.torchrun: 2 nodes, c10d rendezvous), as on two
    machines sharing the checkout: the draft and curves of the stage's 2 processes on one machine."""
    torchrun = {"min_nodes": 2, "nproc_per_node": 1, "rdzv_endpoint": f"127.0.0.1:{free_port()}"}
    root = checkout(tmp_path / "repo", data, {"train": TRAIN, "cluster": {"torchrun": torchrun}})
    for output in start_nodes([root, root]):
        assert output.endswith("exit 0"), output
    details = json.loads((root / "metrics/train_details.json").read_text())
    assert details["processes"] == 2 and details["launcher_restarts"] == 0
    assert_same_training(root, uninterrupted("eagle3"), live="dvclive/train", draft="models/draft")


@pytest.mark.slow
def test_nodes_that_do_not_share_the_checkpoint_folder_are_refused(data: Path, tmp_path: Path):
    """Two nodes, each with a checkout of its own (checkpoints in each one's .eaglenest/): rank 1 would never see
    rank 0's checkpoints, so the processes stop before training, in one line naming the param."""
    torchrun = {"min_nodes": 2, "nproc_per_node": 1, "rdzv_endpoint": f"127.0.0.1:{free_port()}", "max_restarts": 0}
    params = {"train": TRAIN, "cluster": {"torchrun": torchrun}}
    outputs = start_nodes([checkout(tmp_path / node, data, params) for node in ("a", "b")])
    assert all(output.endswith("exit 2") for output in outputs), outputs
    text = "\n".join(outputs)
    assert ".eaglenest/train-checkpoints/" in text and "rank 1 of 2, on" in text
    assert (
        "cannot read what rank 0 wrote there, so it would not resume from rank 0's checkpoints; point "
        "cluster.torchrun.checkpoint_dir at storage every node mounts at the same path" in text
    )
    assert not (tmp_path / "a/models/draft").exists() and not (tmp_path / "b/models/draft").exists()


LAUNCH_PARAMS = {"train": {"nproc": 16}, "cluster": {"torchrun": {"max_nodes": 2, "max_restarts": 5}}}


def printed_line(root: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, *flags: str) -> str:
    monkeypatch.chdir(root)
    assert main(["train-launch", "--print", *flags]) == 0
    return capsys.readouterr().out


def test_the_printed_launch_line_is_torchruns_with_the_stage_of_dvc_yaml(
    tmp_path: Path, data: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
):
    from torch.distributed.run import get_args_parser

    root = checkout(tmp_path / "repo", data, LAUNCH_PARAMS)
    line = printed_line(root, capsys, monkeypatch, "--rdzv-endpoint", "node-a:29400", "--rdzv-id", "job-7")
    assert line.endswith("\n") and line.count("\n") == 1
    env, program, *flags = shlex.split(line)
    assert (env, program) == ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", "torchrun")
    args = get_args_parser().parse_args(flags)  # torchrun's own parser
    assert (args.nnodes, args.nproc_per_node, args.max_restarts) == ("1:2", "8", 5)  # 16 = 2 nodes x 8, or 1 x 16
    assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == ("c10d", "node-a:29400", "job-7")
    python, *stage = shlex.split(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["train"]["cmd"])
    assert [args.training_script, *args.training_script_args] == stage and python == "python"
    # without flags: cluster.torchrun's endpoint and id
    params = {**LAUNCH_PARAMS, "cluster": {"torchrun": {"rdzv_endpoint": "10.0.0.1:29500", "min_nodes": 2}}}
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    args = get_args_parser().parse_args(shlex.split(printed_line(root, capsys, monkeypatch))[2:])
    assert (args.nnodes, args.nproc_per_node, args.rdzv_endpoint, args.rdzv_id) == (
        "2:2",
        "8",
        "10.0.0.1:29500",
        "eaglenest-train",
    )


FAKE_SLURM = {
    # the allocation's nodes, first one first
    "scontrol": "echo node-a; echo node-b",
    # srun as the first node: its command, with --print, says what it would run there
    "srun": 'while [[ "$1" == -* ]]; do echo "srun $1" >> "$SRUN_OPTIONS"; shift; done; exec "$@" --print',
    "dvc": 'echo "dvc $*"',
}


def test_the_slurm_script_runs_the_printed_line_on_every_node(
    tmp_path: Path, data: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
):
    script = REPO / "scripts" / "cluster" / "train.sbatch"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True).returncode == 0
    root = checkout(tmp_path / "repo", data, LAUNCH_PARAMS)
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, body in FAKE_SLURM.items():
        (fake / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (fake / name).chmod(0o755)
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_SUBMIT_DIR": str(root),
        "SRUN_OPTIONS": str(tmp_path / "srun-options"),
    }
    env = project_env(**slurm, PATH=f"{fake}{os.pathsep}{project_env()['PATH']}")
    result = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    line = printed_line(root, capsys, monkeypatch, "--rdzv-endpoint", "node-a:29500", "--rdzv-id", "eaglenest-4242")
    assert result.stdout == line + "dvc commit --force train\n"
    # one launcher per node, and a failed node does not end the others
    assert (tmp_path / "srun-options").read_text().split() == [
        "srun",
        "--ntasks-per-node=1",
        "srun",
        "--kill-on-bad-exit=0",
    ]
    # --print inside an allocation prints the same line; outside one the script says so
    printed = subprocess.run(
        ["bash", str(script), "--print"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert printed.stdout == line
    alone = subprocess.run(["bash", str(script)], cwd=tmp_path, env=project_env(), capture_output=True, text=True)
    assert alone.returncode == 2 and alone.stderr.strip() == (
        "train.sbatch: no Slurm allocation (SLURM_JOB_NODELIST is unset); submit it with sbatch"
    )


def test_bad_launcher_settings_are_one_line_each(
    tmp_path: Path, data: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
):
    with pytest.raises(ParamsError) as info:
        parse_params(
            {
                "train": {"nproc": 12},
                "cluster": {
                    "torchrun": {
                        "max_restarts": -1,
                        "rdzv_endpoint": "head",
                        "min_nodes": 1,
                        "max_nodes": 3,
                        "nproc_per_node": 4,
                    }
                },
            }
        )
    assert str(info.value).splitlines()[1:] == [
        "  - cluster.torchrun.max_restarts = -1: Input should be greater than or equal to 0",
        "  - cluster.torchrun.rdzv_endpoint = 'head': must be HOST:PORT: a host name or IPv4 address, and a port in "
        "1..65535",
        "  - train.nproc = 12 (the global batch, in packed sequences) is not a multiple of the world size 8 (2 node(s) "
        "x 4 processes per node) that cluster.torchrun's node bounds 1..3 allow; every world size must divide it: "
        "change the bounds, cluster.torchrun.nproc_per_node or train.nproc",
    ]
    with pytest.raises(ParamsError, match="cluster.torchrun.max_nodes = 1 < cluster.torchrun.min_nodes = 2"):
        parse_params({"cluster": {"torchrun": {"min_nodes": 2, "max_nodes": 1}}, "train": {"nproc": "two"}})
    # The launcher is never started: an endpoint that does not resolve, none at all, or a malformed one.
    root = checkout(tmp_path / "repo", data, {"train": TRAIN})
    monkeypatch.chdir(root)
    for flags, message in (
        (
            ["--rdzv-endpoint", "no-such-node.invalid:29500"],
            "rendezvous endpoint no-such-node.invalid:29500: the host 'no-such-node.invalid' does not resolve",
        ),
        (
            [],
            "no rendezvous endpoint: give --rdzv-endpoint HOST:PORT (the first node, where its launcher hosts "
            "the rendezvous) or set cluster.torchrun.rdzv_endpoint",
        ),
        (["--rdzv-endpoint", "node-a:http"], "--rdzv-endpoint 'node-a:http': must be HOST:PORT"),
    ):
        assert main(["train-launch", *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"eaglenest train-launch: error: {message}"), err
    assert not (root / "models" / "draft").exists()


@pytest.mark.slow
def test_a_streamed_run_on_two_processes_restarted_after_a_kill_trains_the_stored_draft(
    streamed: Path, uninterrupted, tmp_path: Path
):
    """extract.store: stream under torchrun's elastic launcher: each process streams its own sequences from its own
    engine; a worker killed after the step-3 checkpoint (its engine dies with it) is restarted, both resume and
    stream from step 3, and the draft and curves are the stored run's."""
    wrapper = tmp_path / "kill_after_checkpoint.py"
    wrapper.write_text(KILL_AFTER_CHECKPOINT.format(rank=1))
    result = run_train_stage(tmp_path, streamed, TRAIN, script=wrapper)
    assert result.returncode == 0, result.stdout + result.stderr
    details = json.loads((tmp_path / "train_details.json").read_text())
    assert (details["processes"], details["launcher_restarts"], details["resumed_from_step"]) == (2, 1, 3)
    assert details["hidden_states"] == "stream" and details["stream"]["engines"] == 1
    assert_same_training(tmp_path, uninterrupted("eagle3"))
