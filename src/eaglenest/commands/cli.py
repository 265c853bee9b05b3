"""The ``eaglenest`` command: its parser, built from the commands' registry, and its entry point.

Every command is declared by its own module (``COMMAND``, see :mod:`eaglenest.commands.command`); adding one is
that module and its entry in ``COMMAND_MODULES``. The modules import only the standard library and eaglenest's
own light modules at their top (third-party packages when a command runs), so ``eaglenest --help`` and
``eaglenest doctor`` run in an interpreter without any of them.
"""

from __future__ import annotations

import argparse
import sys

from eaglenest.commands import (
    bench,
    doctor,
    export,
    importer,
    init_command,
    inspect,
    k_sweep,
    remote,
    replay,
    report_command,
    serve,
    summary,
    train_launch_command,
)
from eaglenest.commands.command import Command
from eaglenest.core.errors import EaglenestError
from eaglenest.core.registry import Registry

DESCRIPTION = (
    "eaglenest trains EAGLE-3 speculative-decoding drafts for a verifier LLM and measures how much faster they "
    "make it. The pipeline runs with DVC (`dvc repro`: stages in dvc.yaml, every knob in params.yaml); these "
    "commands set it up, check and inspect what it makes, compare runs, and serve the draft with vLLM."
)
EPILOG = "`eaglenest COMMAND --help` describes each command. Reference: docs/cli.md and docs/params.md."

# The modules that declare the commands, in the order `eaglenest --help` lists them.
COMMAND_MODULES = (
    doctor,
    inspect,
    export,
    importer,
    report_command,
    summary,
    remote,
    serve,
    replay,
    init_command,
    k_sweep,
    bench,
    train_launch_command,
)
COMMANDS: Registry[Command] = Registry("command")
for _module in COMMAND_MODULES:
    COMMANDS.register(_module.COMMAND.name, _module.COMMAND)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every registered command, each in ``COMMAND_MODULES``' order."""
    parser = argparse.ArgumentParser(prog="eaglenest", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"eaglenest {_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (module.COMMAND for module in COMMAND_MODULES):
        sub = subparsers.add_parser(command.name, help=command.help, description=command.sentence)
        command.add_arguments(sub)
    return parser


def _version() -> str:
    """The installed distribution's version (a source tree that was never installed has none)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("eaglenest")
    except PackageNotFoundError:
        return "(not installed)"


def parse(argv: list[str]) -> tuple[argparse.Namespace, Command]:
    """The parsed arguments of ``eaglenest ARGV`` and the command they name.

    Everything after ``--`` goes on as ``passthrough_args``, for the commands that pass flags on (``eaglenest serve
    ... -- FLAGS`` to vLLM's server, ``eaglenest bench --serve ... -- FLAGS`` to the servers it starts, ``eaglenest
    remote push|pull ... -- FLAGS`` to DVC); the others refuse it (argparse's one line, exit status 2). A command
    with actions of its own says per action whether it passes them (``passes_flags`` in the action's parsed
    arguments).
    """
    passthrough_args: list[str] = []
    if "--" in argv:
        separator = argv.index("--")
        argv, passthrough_args = argv[:separator], argv[separator + 1 :]
    parser = build_parser()
    args = parser.parse_args(argv)
    command = COMMANDS.get(args.command)
    if passthrough_args and not getattr(args, "passes_flags", command.passes_flags):
        parser.error(
            f"{args.command}: takes no arguments after --; only `eaglenest serve -- FLAGS` and "
            "`eaglenest bench --serve -- FLAGS` pass flags on (to vLLM), and `eaglenest remote push|pull "
            "-- FLAGS` (to DVC)"
        )
    args.passthrough_args = passthrough_args
    return args, command


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script: runs the command ``argv`` names (:func:`parse`); its exit status."""
    args, command = parse(list(sys.argv[1:] if argv is None else argv))
    try:
        return command.run(args)
    except EaglenestError as err:
        print(f"eaglenest {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
