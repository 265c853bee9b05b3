"""``eaglenest remote``: a team's DVC remote. Push and pull (DVC's objects and run-cache, then prepare's caches) and
experiments, each failure one line naming the remote and what to do; and an S3 store on this machine (SeaweedFS'
``weed mini``) with the DVC remote on it.

The package, by concern: ``store`` (the store's process, ports, credentials and state file: start, stop, status),
``dvc_config`` (the DVC remote in the repository's config, and the one line a failure against it prints),
``transfer`` (push and pull: DVC's objects and run-cache, then prepare's caches) and ``experiments`` (exp-push,
exp-pull). This module declares the command and its actions, each an argparse subcommand (:data:`ACTIONS`) with
only the arguments it takes, so that argparse refuses any other.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from pathlib import Path

from eaglenest.commands.command import Command
from eaglenest.commands.remote.dvc_config import DEFAULT_REMOTE, configure_remote
from eaglenest.commands.remote.experiments import exp_pull, exp_push
from eaglenest.commands.remote.store import DEFAULT_STORE_DIR, start_store, stop_store, store_status
from eaglenest.commands.remote.transfer import transfer


def start(repo: Path, directory: Path, name: str = DEFAULT_REMOTE, force: bool = False) -> int:
    """``eaglenest remote start``: runs the store in ``directory`` and makes it the DVC remote ``name``.

    Args:
        repo: The repository whose .dvc/config.local gets the remote.
        directory: The store's folder.
        name: The DVC remote.
        force: Replace a DVC remote ``name`` that points elsewhere.

    Raises:
        EaglenestError: the store did not start, or a remote ``name`` points elsewhere (one line).
    """
    store = start_store(directory)
    configured = configure_remote(repo, store, name, force=force)
    print(
        f"store up at {store.endpoint} (objects in {directory / 'data'}, pid {store.pid}); {configured}: "
        f"`eaglenest remote push`, `eaglenest remote pull`"
    )
    return 0


def stop(directory: Path) -> int:
    """``eaglenest remote stop``: stops the store in ``directory``, keeping its objects."""
    print(f"store in {directory} stopped" if stop_store(directory) else f"no store running in {directory}")
    return 0


def status(directory: Path) -> int:
    """``eaglenest remote status``: 0 where the store in ``directory`` runs, else 1."""
    store = store_status(directory)
    if store is None:
        print(f"no store running in {directory}; start it with `eaglenest remote start`")
        return 1
    print(f"store up at {store.endpoint} (objects in {directory / 'data'}, pid {store.pid})")
    return 0


def _store_dir(args: argparse.Namespace) -> Path:
    """``--dir``, resolved against ``--repo``."""
    directory = Path(args.dir)
    return directory if directory.is_absolute() else Path(args.repo) / directory


def _transfer(args: argparse.Namespace) -> int:
    print("\n".join(transfer(Path(args.repo), args.action, args.name, args.targets, args.passthrough_args)))
    return 0


def _experiment(sync: Callable[[Path, str, str, str], list[str]], args: argparse.Namespace) -> int:
    """exp-push or exp-pull (``sync``) of the experiment NAME with the Git remote GIT_REMOTE."""
    print("\n".join(sync(Path(args.repo), args.experiment, args.git_remote, args.name)))
    return 0


def _add_repo(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repo", default=".", help="the repository (default: the current folder)")


def _add_name(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", default=DEFAULT_REMOTE, help=f"the DVC remote's name (default: {DEFAULT_REMOTE})")


def _add_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dir",
        default=str(DEFAULT_STORE_DIR),
        help=f"the store's folder: objects, log and state "
        f"(default: {DEFAULT_STORE_DIR}; a second clone on this machine names the first one's)",
    )
    _add_repo(parser)


def _start_arguments(parser: argparse.ArgumentParser) -> None:
    _add_dir(parser)
    _add_name(parser)
    parser.add_argument(
        "--force", action="store_true", help="replace a DVC remote --name that points elsewhere (default: refused)"
    )


def _transfer_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("targets", nargs="*", metavar="TARGET", help="DVC targets (default: all)")
    _add_name(parser)
    _add_repo(parser)


def _experiment_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("experiment", metavar="NAME", help="the experiment")
    parser.add_argument(
        "git_remote", nargs="?", default="origin", metavar="GIT_REMOTE", help="the Git remote (default: origin)"
    )
    _add_name(parser)
    _add_repo(parser)


# Each action, in the order `eaglenest remote --help` lists them.
ACTIONS = (
    Command(
        "push",
        help="send DVC's objects and run-cache (dvc push --run-cache) to the DVC remote --name, then "
        "prepare's caches (only entries the other side lacks); DVC's own flags go after -- (eaglenest remote "
        "push -- --jobs 4)",
        add_arguments=_transfer_arguments,
        run=_transfer,
        passes_flags=True,
    ),
    Command(
        "pull",
        help="fetch DVC's objects and run-cache (dvc pull --run-cache) from the DVC remote --name, then "
        "prepare's caches (only entries this side lacks); DVC's own flags go after --",
        add_arguments=_transfer_arguments,
        run=_transfer,
        passes_flags=True,
    ),
    Command(
        "exp-push",
        help="send the experiment NAME (dvc exp push --run-cache), refused where the Git remote "
        "(default origin) holds another experiment NAME",
        add_arguments=_experiment_arguments,
        run=partial(_experiment, exp_push),
    ),
    Command(
        "exp-pull",
        help="fetch the experiment NAME (dvc exp pull --run-cache), refused where this clone holds "
        "another experiment NAME",
        add_arguments=_experiment_arguments,
        run=partial(_experiment, exp_pull),
    ),
    Command(
        "start",
        help="run SeaweedFS (weed mini) on free 127.0.0.1 ports, every port asking for credentials, "
        "and make it the DVC remote --name in .dvc/config.local",
        description="Run SeaweedFS (weed mini) on free 127.0.0.1 ports, every port asking for credentials (made "
        "once, kept across restarts), and make it the DVC remote --name in .dvc/config.local (0600; nothing "
        "enters git), the default where the repository has none; a remote of that name elsewhere is refused "
        "(--force replaces it); one start or stop per store at a time.",
        add_arguments=_start_arguments,
        run=lambda args: start(Path(args.repo), _store_dir(args), args.name, args.force),
    ),
    Command(
        "stop",
        help="stop the store, keeping its objects",
        add_arguments=_add_dir,
        run=lambda args: stop(_store_dir(args)),
    ),
    Command(
        "status",
        help="say whether the store runs: exit 0 where it does, 1 where not",
        add_arguments=_add_dir,
        run=lambda args: status(_store_dir(args)),
    ),
)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action in ACTIONS:
        sub = actions.add_parser(action.name, help=action.help, description=action.sentence)
        action.add_arguments(sub)
        # main() refuses flags after -- for an action that takes none, as it does for a command.
        sub.set_defaults(run_action=action.run, passes_flags=action.passes_flags)


COMMAND = Command(
    "remote",
    help="the team's DVC remote: push and pull (with prepare's caches), experiments, and an S3 store on this machine",
    description="The team's DVC remote: push and pull (DVC's objects and run-cache, then prepare's caches), "
    "experiments, and an S3 store on this machine (SeaweedFS' weed mini) to try it with. A failure is one line "
    "naming the remote and what to do. A remote elsewhere (AWS S3, GCS, MinIO): docs/team-remote.md. "
    "`eaglenest remote ACTION --help` describes each action and its arguments.",
    add_arguments=_add_arguments,
    passes_flags=True,
    run=lambda args: args.run_action(args),
)
