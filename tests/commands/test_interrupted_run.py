"""A `dvc exp run` killed mid-stage, with real git and DVC on a one-stage repository (seconds, not a pipeline): the
next run is not blocked, but HEAD stays detached and the killed run's -S values stay in params.yaml until fixed;
`eaglenest doctor`'s check names both with the commands that clear them, and those commands do."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

from eaglenest.commands.interrupted_run import EXEC_BASELINE, interrupted_run_problems
from tests.fixtures.pipeline import VENV_BIN, dvc, project_env, run

# The stage waits while params say x: 2 (the run that is killed), and finishes at once otherwise.
STAGE = (
    "import pathlib, sys, time, yaml\n"
    "x = yaml.safe_load(open('params.yaml'))['x']\n"
    "pathlib.Path('started').write_text('')\n"
    "time.sleep(120 if x == 2 else 0)\n"
    "pathlib.Path('out.txt').write_text(str(x))\n"
)


def one_stage_repo(repo: Path) -> Path:
    repo.mkdir()
    run(["git", "init", "-q", "-b", "main"], repo)
    dvc(["init", "-q"], repo)
    (repo / "params.yaml").write_text("x: 1\n")
    (repo / "stage.py").write_text(STAGE)
    (repo / "dvc.yaml").write_text(
        "stages:\n  wait:\n    cmd: python stage.py\n    deps: [stage.py]\n    params: [x]\n    outs: [out.txt]\n"
    )
    (repo / ".gitignore").write_text("started\n")
    dvc(["repro", "-q"], repo)
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "baseline"], repo)
    (repo / "started").unlink()  # the baseline's run started the stage too
    return repo


def fixes(problem: str) -> list[str]:
    """The commands a problem line gives to clear it (the `git ...` spans after 'fix:', 'drop them with', ...)."""
    return [span for span in re.findall(r"`([^`]+)`", problem) if span.startswith(("git checkout", "git update-ref"))]


def test_a_killed_exp_run_is_reported_with_the_commands_that_clear_it(tmp_path: Path):
    repo = one_stage_repo(tmp_path / "repo")
    killed = subprocess.Popen(
        [str(VENV_BIN / "dvc"), "exp", "run", "-S", "x=2"],
        cwd=repo,
        env=project_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not (repo / "started").exists() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (repo / "started").exists(), "the stage never started"
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()

    detached, interrupted = interrupted_run_problems(repo)
    assert "HEAD is detached" in detached and fixes(detached) == ["git checkout main"]
    assert EXEC_BASELINE in interrupted and "params.yaml" in interrupted
    assert fixes(interrupted) == [
        "git checkout HEAD -- params.yaml",
        f"git update-ref -d {EXEC_BASELINE} && git update-ref -d refs/exps/exec/EXEC_MERGE",
    ]

    # The next run is not blocked, and takes the killed run's x: 2 into its own unless -S overrides it; HEAD stays
    # detached after it (its refs are its own again, so only the detachment is left to report).
    dvc(["exp", "run", "-S", "x=3"], repo)
    assert (repo / "out.txt").read_text() == "3"
    [still_detached] = interrupted_run_problems(repo)
    assert fixes(still_detached) == ["git checkout main"]

    for command in fixes(still_detached) + ["git checkout HEAD -- params.yaml"]:
        for part in command.split(" && "):
            run(shlex.split(part), repo)
    assert interrupted_run_problems(repo) == []
    assert run(["git", "symbolic-ref", "HEAD"], repo).stdout.strip() == "refs/heads/main"


def test_nothing_is_reported_for_a_repository_without_git_or_a_clean_one(tmp_path: Path):
    assert interrupted_run_problems(tmp_path) == []
    assert interrupted_run_problems(one_stage_repo(tmp_path / "repo")) == []
