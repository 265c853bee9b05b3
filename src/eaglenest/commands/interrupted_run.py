"""What a ``dvc exp run`` killed in the workspace leaves behind, each with the command that clears it.

Measured with DVC 3.67 (a workspace ``dvc exp run -S ...`` killed with SIGKILL mid-stage, then another run): the
next ``dvc exp run`` is not blocked (DVC drops the experiment's stash entry before it runs, and its locks name the
dead process, which the next run releases), but two things stay wrong without a word:

* HEAD is left detached at the experiment's baseline commit (DVC detaches it to run and restores it only on the way
  out), and later experiments keep it so: commits made there belong to no branch;
* the workspace keeps the killed experiment's ``-S`` changes (params.yaml, staged), which the next ``dvc exp run``
  then silently includes.

DVC also leaves its ``refs/exps/exec/EXEC_BASELINE`` and ``EXEC_MERGE`` refs, which a finished run removes: they
say that the last run was interrupted. ``eaglenest doctor`` reports both, unless a run is in progress.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

EXEC_HEAD = "refs/exps/exec/EXEC_HEAD"
EXEC_BASELINE = "refs/exps/exec/EXEC_BASELINE"
EXEC_MERGE = "refs/exps/exec/EXEC_MERGE"
# The workspace run's process record (dvc_task's ProcessInfo), there while a run is in progress.
RUN_INFO = Path(".dvc/tmp/exps/run/workspace/workspace.json")


def _git(repo: Path, *args: str) -> str | None:
    """git's output, stripped; None when git fails (a ref that does not exist, not a repository)."""
    try:
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False)
    except OSError:  # no git at all
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def run_in_progress(repo: Path) -> bool:
    """A ``dvc exp run`` in the workspace is running now: its process record names a live process."""
    try:
        pid = int(json.loads((repo / RUN_INFO).read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def interrupted_run_problems(repo: Path) -> list[str]:
    """What a killed ``dvc exp run`` left in ``repo``, one line each with its fix; [] when nothing (or a run is in
    progress, whose state is its own)."""
    if _git(repo, "rev-parse", "--git-dir") is None or run_in_progress(repo):
        return []
    problems = []
    head = _git(repo, "rev-parse", "-q", "--verify", "HEAD")
    detached = _git(repo, "symbolic-ref", "-q", "HEAD") is None
    if head is not None and detached and _git(repo, "rev-parse", "-q", "--verify", EXEC_HEAD) == head:
        branches = (
            _git(repo, "for-each-ref", "--points-at", head, "--format=%(refname:short)", "refs/heads") or ""
        ).split()
        fix = f"git checkout {branches[0]}" if branches else "git checkout -b NAME"
        where = f", where branch {branches[0]} points" if branches else ""
        problems.append(
            f"HEAD is detached at {head[:7]}{where}, as `dvc exp run` leaves it when it is killed (later "
            f"runs keep it so, and commits there belong to no branch); fix: `{fix}`"
        )
    if _git(repo, "rev-parse", "-q", "--verify", EXEC_BASELINE) is not None:
        changed = (_git(repo, "diff", "HEAD", "--name-only") or "").split()
        kept = (
            f"the workspace keeps its changes to {', '.join(changed)} (its -S values), which the next "
            f"`dvc exp run` would include: see them with `git diff HEAD`, drop them with "
            f"`git checkout HEAD -- {' '.join(changed)}`; then "
            if changed
            else ""
        )
        problems.append(
            f"a `dvc exp run` was interrupted ({EXEC_BASELINE} is left): {kept}clear its refs with "
            f"`git update-ref -d {EXEC_BASELINE} && git update-ref -d {EXEC_MERGE}`"
        )
    return problems
