"""Running the real CLI tools (dvc, the stage scripts) in temporary git + DVC repositories."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def project_env(**extra: str) -> dict[str, str]:
    """The environment `make` gives stages: the project's interpreter first on PATH, offline."""
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"})
    env.update(extra)
    return env


def run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, check: bool = True,
        timeout: int = 900) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, cwd=cwd, env=env or project_env(), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{cmd} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def make_pipeline_repo(dest: Path, params_overrides: dict | None = None) -> Path:
    """A fresh git + DVC repository holding this project's pipeline, with params overridden."""
    dest.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".*")
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy(REPO / name, dest / name)
    for name in ("stages", "src"):
        shutil.copytree(REPO / name, dest / name, ignore=ignore)
    shutil.copytree(REPO / "data" / "eval", dest / "data" / "eval")  # the general evaluation set
    (dest / "data" / "conversations").mkdir(parents=True)
    (dest / "data" / "conversations" / ".gitkeep").touch()
    params = yaml.safe_load((dest / "params.yaml").read_text())
    for section, values in (params_overrides or {}).items():
        params.setdefault(section, {}).update(values)
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run(["git", "init", "-q"], dest)
    run([str(VENV_BIN / "dvc"), "init", "-q"], dest)
    run([str(VENV_BIN / "dvc"), "config", "core.analytics", "false"], dest)
    run(["git", "add", "-A"], dest)
    run(["git", "commit", "-qm", "pipeline"], dest)
    return dest


def dvc(args: list[str], repo: Path, check: bool = True, env: dict[str, str] | None = None):
    return run([str(VENV_BIN / "dvc"), *args], repo, env=env, check=check)
