"""The style checks: `make lint` runs the formatter's check, ruff's rules and mypy; CI runs it before the tests; the
pre-commit hooks run the same programs, all local (none fetches code); and each check fails on what it is for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from tests.fixtures.pipeline import REPO

VENV_BIN = Path(sys.executable).parent


def _make_lint_commands() -> list[str]:
    dry = subprocess.run(["make", "-n", "lint"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [line.strip() for line in dry.splitlines() if "/bin/ruff" in line or "/bin/mypy" in line]


def test_make_lint_runs_the_three_checks_and_ci_runs_it_before_the_tests():
    assert [command.split("/bin/", 1)[1] for command in _make_lint_commands()] == [
        "ruff format --check .",
        "ruff check .",
        "mypy",
    ]
    steps = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line.startswith("make ")]
    assert steps == ["make lint", "make test"]


def test_the_pre_commit_hooks_run_make_lints_programs_locally():
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    assert [repo["repo"] for repo in config["repos"]] == ["local"]
    hooks = [hook for repo in config["repos"] for hook in repo["hooks"]]
    assert {hook["language"] for hook in hooks} == {"system"}
    entries = [hook["entry"].split("/bin/", 1)[1] for hook in hooks]
    assert entries == ["ruff format --check", "ruff check", "mypy"]


def test_each_check_fails_on_what_it_is_for(tmp_path: Path):
    (tmp_path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    package = tmp_path / "src" / "eaglenest" / "core"
    package.mkdir(parents=True)
    (tmp_path / "src" / "eaglenest" / "artifacts").mkdir()
    (tmp_path / "src" / "eaglenest" / "artifacts" / "good.py").write_text("y: int = 1\n")
    (package / "bad.py").write_text("import os\nx: int = 'a'\ndef f( a ):\n    return a\n")
    ruff, mypy = str(VENV_BIN / "ruff"), str(VENV_BIN / "mypy")
    for command, said in (
        ([ruff, "format", "--check", "."], "would be reformatted"),
        ([ruff, "check", "."], "F401"),
        ([mypy], "Incompatible types in assignment"),
    ):
        result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True)
        assert result.returncode != 0 and said in result.stdout + result.stderr, (command, result)
