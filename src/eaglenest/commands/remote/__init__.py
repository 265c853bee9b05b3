"""``eaglenest remote``: a team's DVC remote. Push and pull (DVC's objects and run-cache, then prepare's caches) and
experiments, each failure one line naming the remote and what to do; and an S3 store on this machine (SeaweedFS'
``weed mini``) with the DVC remote on it.

The package, by concern: ``store`` (the store's process, ports, credentials and state file: start, stop, status),
``dvc_config`` (the DVC remote in the repository's config, and the one line a failure against it prints),
``transfer`` (push and pull: DVC's objects and run-cache, then prepare's caches) and ``experiments`` (exp-push,
exp-pull). This module declares the command and runs each action from :data:`ACTIONS`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from eaglenest.commands.command import Command
from eaglenest.commands.remote.dvc_config import DEFAULT_REMOTE, configure_remote
from eaglenest.commands.remote.experiments import exp_pull, exp_push
from eaglenest.commands.remote.store import DEFAULT_STORE_DIR, start_store, stop_store, store_status
from eaglenest.commands.remote.transfer import transfer
from eaglenest.core.errors import EaglenestError


@dataclass(frozen=True)
class Call:
    """One ``eaglenest remote`` call: :func:`remote`'s arguments, ``directory`` resolved against ``repo``."""

    action: str
    repo: Path
    directory: Path
    name: str
    args: list[str]
    dvc_flags: list[str]
    force: bool


@dataclass(frozen=True)
class Action:
    """What ``eaglenest remote ACTION`` runs, and what it takes besides the action.

    Attributes:
        run: Runs the call and prints what happened; the exit status.
        takes_args: It takes ARGs (DVC targets, or the experiment and its Git remote).
        takes_flags: It takes DVC's own flags after ``--``.
    """

    run: Callable[[Call], int]
    takes_args: bool = False
    takes_flags: bool = False


def remote(action: str, repo: Path, directory: Path, name: str, args: list[str], dvc_flags: list[str],
           force: bool = False) -> int:
    """``eaglenest remote ACTION [ARGS] [-- DVC_FLAGS]``: prints what happened, returns the exit status.

    Args:
        action: start, stop, status; push, pull (DVC and prepare's caches); exp-push, exp-pull.
        repo: The repository.
        directory: The store's folder (start, stop, status).
        name: The DVC remote.
        args: push / pull: DVC targets; exp-push / exp-pull: the experiment, then the Git remote (default origin).
        dvc_flags: push / pull: DVC's own flags (``--jobs``, ``--all-commits``, ...).
        force: start: replace a DVC remote ``name`` that points elsewhere.

    Raises:
        EaglenestError: arguments the action does not take, or its failure (one line).
    """
    chosen = ACTIONS[action]
    if (args and not chosen.takes_args) or (dvc_flags and not chosen.takes_flags):
        raise EaglenestError(f"{action} takes no {'arguments' if args else 'flags after --'}: "
                             f"{' '.join(args or dvc_flags)}")
    directory = directory if directory.is_absolute() else repo / directory
    return chosen.run(Call(action, repo, directory, name, args, dvc_flags, force))


def _push_or_pull(call: Call) -> int:
    print("\n".join(transfer(call.repo, call.action, call.name, call.args, call.dvc_flags)))
    return 0


def _experiment(sync: Callable[[Path, str, str, str], list[str]], call: Call) -> int:
    """exp-push or exp-pull (``sync``) of the experiment ARGS name, with the Git remote ARGS may name next."""
    if not 1 <= len(call.args) <= 2:
        raise EaglenestError(f"{call.action} takes the experiment's name and, optionally, the Git remote (default "
                             f"origin): eaglenest remote {call.action} NAME [GIT_REMOTE]")
    print("\n".join(sync(call.repo, call.args[0], call.args[1] if len(call.args) == 2 else "origin", call.name)))
    return 0


def _start(call: Call) -> int:
    store = start_store(call.directory)
    configured = configure_remote(call.repo, store, call.name, force=call.force)
    print(f"store up at {store.endpoint} (objects in {call.directory / 'data'}, pid {store.pid}); {configured}: "
          f"`eaglenest remote push`, `eaglenest remote pull`")
    return 0


def _stop(call: Call) -> int:
    print(f"store in {call.directory} stopped" if stop_store(call.directory) else
          f"no store running in {call.directory}")
    return 0


def _status(call: Call) -> int:
    store = store_status(call.directory)
    if store is None:
        print(f"no store running in {call.directory}; start it with `eaglenest remote start`")
        return 1
    print(f"store up at {store.endpoint} (objects in {call.directory / 'data'}, pid {store.pid})")
    return 0


# Each action, in the order `eaglenest remote --help` lists them.
ACTIONS: dict[str, Action] = {
    "push": Action(_push_or_pull, takes_args=True, takes_flags=True),
    "pull": Action(_push_or_pull, takes_args=True, takes_flags=True),
    "exp-push": Action(partial(_experiment, exp_push), takes_args=True),
    "exp-pull": Action(partial(_experiment, exp_pull), takes_args=True),
    "start": Action(_start),
    "stop": Action(_stop),
    "status": Action(_status),
}


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=list(ACTIONS), help="what to do (above)")
    parser.add_argument("args", nargs="*", metavar="ARG", help="push / pull: DVC targets (default: all); exp-push / "
                        "exp-pull: NAME [GIT_REMOTE]")
    parser.add_argument("--dir", default=str(DEFAULT_STORE_DIR), help=f"the store's folder: objects, log and state "
                        f"(default: {DEFAULT_STORE_DIR}; a second clone on this machine names the first one's)")
    parser.add_argument("--name", default=DEFAULT_REMOTE, help=f"the DVC remote's name (default: {DEFAULT_REMOTE})")
    parser.add_argument("--repo", default=".", help="the repository (default: the current folder)")
    parser.add_argument("--force", action="store_true", help="start: replace a DVC remote --name that points "
                        "elsewhere (default: refused)")


COMMAND = Command(
    "remote", help="the team's DVC remote: push and pull (with prepare's caches), experiments, and an S3 "
    "store on this machine",
    description="The team's DVC remote. push / pull: dvc push / pull --run-cache to the DVC remote --name, "
    "then prepare's caches (only entries the other side lacks); ARGS are DVC targets, DVC's own flags go after "
    "-- (eaglenest remote push -- --jobs 4). exp-push NAME [GIT_REMOTE]: dvc exp push --run-cache, refused "
    "where the Git remote (default origin) holds another experiment NAME; exp-pull NAME [GIT_REMOTE]: dvc exp "
    "pull --run-cache. A failure is one line naming the remote and what to do. start: runs SeaweedFS (weed "
    "mini) on free 127.0.0.1 ports, every port asking for credentials (made once, kept across restarts), and "
    "makes it the DVC remote --name in .dvc/config.local (0600; nothing enters git), the default where the "
    "repository has none; a remote of that name elsewhere is refused (--force replaces it); one start or stop "
    "per store at a time; stop: stops it, keeping its objects; status: "
    "exit 0 where it runs. A remote elsewhere (AWS S3, GCS, MinIO): docs/team-remote.md.",
    add_arguments=_add_arguments, passes_flags=True,
    run=lambda args: remote(args.action, Path(args.repo), Path(args.dir), args.name, args.args, args.vllm_args,
                            args.force))
