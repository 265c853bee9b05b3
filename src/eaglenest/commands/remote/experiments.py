"""``eaglenest remote exp-push|exp-pull``: an experiment's Git ref, outputs and run-cache (``dvc exp push|pull
--run-cache``), refused where the other side holds another experiment of that name (the Git remote's refs, listed
by ``git ls-remote``, and DVC's own divergence line).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from eaglenest.commands.remote.dvc_config import dvc_remote
from eaglenest.commands.remote.transfer import run_dvc, verify_run_cache
from eaglenest.core.errors import EaglenestError

# DVC 3.67's line for an experiment whose name the Git remote holds for another commit (exit status 0).
DIVERGED_MARKER = "has diverged from remote experiment"


def _taken(name: str, git_remote: str) -> str:
    return (
        f"experiment {name} on {git_remote} is a teammate's with other outputs: rename yours (`dvc exp rename "
        f"{name} NEW`) and push again; theirs stays as it was"
    )


def _refuse_options(name: str, git_remote: str) -> None:
    """Refuses an experiment or Git remote whose name git or DVC would read as an option (``--upload-pack=CMD``
    makes ``git ls-remote`` run CMD).

    Raises:
        EaglenestError: either starts with ``-``.
    """
    for what, value in (("experiment name", name), ("Git remote", git_remote)):
        if value.startswith("-"):
            raise EaglenestError(
                f"the {what} {value!r} starts with '-', which git would read as an option: give "
                f"a remote's name or URL (`git remote -v` lists them) and an experiment's name"
            )


def _remote_experiments(repo: Path, git_remote: str, name: str) -> dict[str, str]:
    """The Git remote's experiments called ``name``, on any baseline: commit per ref.

    Raises:
        EaglenestError: the Git remote does not answer.
    """
    from dvc.repo.experiments.exceptions import InvalidExpRefError
    from dvc.repo.experiments.refs import EXPS_NAMESPACE, ExpRefInfo

    listed = subprocess.run(
        ["git", "ls-remote", "--", git_remote, f"{EXPS_NAMESPACE}/*"],
        cwd=repo,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    if listed.returncode != 0:
        said = [line for line in listed.stderr.splitlines() if line.strip()]
        # git's first line says what failed ("fatal: 'x' does not appear to be a git repository"); advice follows
        raise EaglenestError(
            f"Git remote {git_remote!r} did not list its experiments: "
            f"{said[0] if said else f'git ls-remote exited {listed.returncode}'}"
        )
    found = {}
    for line in listed.stdout.splitlines():
        commit, ref = line.split("\t")
        try:
            experiment = ExpRefInfo.from_ref(ref)  # refs/exps/AB/CDEF.../NAME: baseline AB..., then the name
        except InvalidExpRefError:  # DVC's own bookkeeping under refs/exps (its stash) names no experiment
            continue
        if experiment.name == name:
            found[ref] = commit
    return found


def _local_experiment(repo: Path, name: str) -> str:
    """The commit of the local experiment ``name``, as ``dvc exp push`` resolves the name.

    Raises:
        EaglenestError: no experiment of that name here, or several that DVC cannot tell apart.
    """
    from dvc.exceptions import DvcException
    from dvc.repo.experiments.utils import resolve_name
    from dvc.scm import SCM

    try:
        scm = SCM(str(repo))
        ref = resolve_name(scm, name)[name]
        commit = None if ref is None else scm.get_ref(str(ref))
    except DvcException as err:
        raise EaglenestError(f"experiment {name}: {err}") from None
    if commit is None:
        raise EaglenestError(f"no experiment {name} in {repo.resolve()} (`dvc exp list` names them)")
    return commit


def exp_push(repo: Path, name: str, git_remote: str, remote_name: str) -> list[str]:
    """``eaglenest remote exp-push NAME GIT_REMOTE``: ``dvc exp push --run-cache -r REMOTE GIT_REMOTE NAME`` (the
    experiment's Git ref, its outputs and its run-cache), refused where the Git remote holds another experiment of
    that name; returns DVC's lines.

    The Git remote's refs are compared before anything moves (on every baseline: DVC would push a same-named
    experiment of another baseline beside the teammate's, and ``dvc exp pull NAME`` would then take the one of the
    commit checked out, and refuse the name as ambiguous on any other), and DVC's own divergence line is read after,
    for a teammate who pushed in between.

    Raises:
        EaglenestError: a name starts with ``-``, the name is taken, or the push failed (one line).
    """
    _refuse_options(name, git_remote)
    commit = _local_experiment(repo, name)
    if any(theirs != commit for theirs in _remote_experiments(repo, git_remote, name).values()):
        raise EaglenestError(_taken(name, git_remote))
    remote = dvc_remote(repo, remote_name)
    said = run_dvc(repo, ["exp", "push", "--run-cache", "-r", remote.name, git_remote, name], remote, "push")
    if DIVERGED_MARKER in said:
        raise EaglenestError(_taken(name, git_remote))
    return said.strip().splitlines()


def exp_pull(repo: Path, name: str, git_remote: str, remote_name: str) -> list[str]:
    """``eaglenest remote exp-pull NAME GIT_REMOTE``: ``dvc exp pull --run-cache -r REMOTE GIT_REMOTE NAME``,
    refused where this clone holds another experiment of that name; returns DVC's lines.

    Raises:
        EaglenestError: a name starts with ``-``, the name is taken here, the pull failed, or a pulled run-cache
            entry was altered (one line).
    """
    _refuse_options(name, git_remote)
    remote = dvc_remote(repo, remote_name)
    said = run_dvc(repo, ["exp", "pull", "--run-cache", "-r", remote.name, git_remote, name], remote, "pull")
    if DIVERGED_MARKER in said:
        raise EaglenestError(
            f"experiment {name} here is another than the one on {git_remote}: rename yours (`dvc "
            f"exp rename {name} NEW`) and pull again; yours stays as it was"
        )
    verify_run_cache(repo)
    return said.strip().splitlines()
