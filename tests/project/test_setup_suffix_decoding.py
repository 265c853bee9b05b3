"""``make setup`` installs suffix decoding (arctic-inference) for the vLLM builds, after the main install, built once
from its sdist and kept in a wheel cache (scripts/suffix_decoding.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest

from tests.fixtures.pipeline import REPO
from tests.project.test_setup import _dry_run, _make_variable

SCRIPT = REPO / "scripts" / "suffix_decoding.py"


def _run(cache: Path, pin: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), pin, *args],
        env=dict(os.environ, EAGLENEST_WHEEL_CACHE=str(cache)),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("vllm", ["cpu", "gpu", "none"])
def test_make_setup_builds_suffix_decoding_for_the_vllm_builds_after_the_main_install(vllm: str, tmp_path: Path):
    venv = tmp_path / "venv"
    lines = _dry_run(vllm, venv)
    step = f"{venv}/bin/python scripts/suffix_decoding.py {_make_variable('SUFFIX_DECODING')}"
    if vllm == "none":
        assert not any("suffix_decoding.py" in line for line in lines), "without vLLM nothing uses suffix decoding"
        return
    assert step in lines, f"make -n setup VLLM={vllm} lacks `{step}`:\n" + "\n".join(lines)
    main_install = next(i for i, line in enumerate(lines) if " -m pip install -q -e " in line)
    assert main_install < lines.index(step), "suffix decoding builds against the torch the main install settled"
    if vllm == "cpu":
        uninstall = next(i for i, line in enumerate(lines) if "uninstall -q -y torchvision" in line)
        assert uninstall < lines.index(step)


def test_the_decision_installed_cached_or_build(tmp_path: Path):
    version = metadata.version("arctic-inference")
    assert _run(tmp_path, f"arctic-inference=={version}", "--decide").stdout.strip() == "installed"
    assert _run(tmp_path, "arctic-inference==9.9.9", "--decide").stdout.strip() == "build"
    folder = tmp_path / "arctic-inference-9.9.9" / f"torch-{metadata.version('torch')}" / sysconfig.get_platform()
    folder.mkdir(parents=True)
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    (folder / f"arctic_inference-9.9.9-{tag}-{tag}-linux_x86_64.whl").write_bytes(b"")
    assert _run(tmp_path, "arctic-inference==9.9.9", "--decide").stdout.strip() == "cached"
    refused = _run(tmp_path, "arctic-inference>=0.3", "--decide")
    assert refused.returncode != 0 and "is not an exact pin NAME==VERSION" in refused.stderr


def test_a_build_that_fails_stops_with_one_line_and_caches_nothing(tmp_path: Path):
    cache = tmp_path / "cache"
    result = _run(cache, "arctic-inference==9.9.9")  # a version no source holds
    assert result.returncode == 1
    log = cache / "suffix-decoding-build.log"
    # offline, in a venv that installed suffix decoding from the cache, the build tools are the step that fails;
    # where they are installed, the build itself: either way one line naming the step and the log
    lines = result.stderr.strip().splitlines()
    assert lines in (
        [f"suffix_decoding.py: building arctic-inference==9.9.9 from its sdist failed; see {log}"],
        [f"suffix_decoding.py: could not install the build tools nanobind==2.9.2 wheel setuptools>=61.0; see {log}"],
    ), result.stderr
    assert "$ pip " in log.read_text()
    assert not list(cache.rglob("*.whl")), "a failed build leaves no wheel a rerun would trust"
    assert (cache.stat().st_mode & 0o777) == 0o700, "a wheel another user could replace would run here"
