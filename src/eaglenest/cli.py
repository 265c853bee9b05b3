"""The ``eaglenest`` command. Heavy imports happen inside the subcommands, so ``doctor`` runs anywhere."""

from __future__ import annotations

import argparse
import sys

from eaglenest.errors import EaglenestError


def _doctor(_args: argparse.Namespace) -> int:
    from eaglenest.environment import doctor

    return doctor()


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="eaglenest", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    doctor = commands.add_parser(
        "doctor", help="check the interpreter, the installed packages and the device"
    )
    doctor.set_defaults(func=_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except EaglenestError as err:
        print(f"eaglenest {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
