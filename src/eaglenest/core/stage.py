"""What every stage entry point shares: argument parsing and the one-line error contract."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from eaglenest.core.errors import EaglenestError


def stage_parser(description: str | None, paths: dict[str, str]) -> argparse.ArgumentParser:
    """A stage's argument parser: ``--params`` plus one required ``--<name>`` per path dvc.yaml passes.

    Args:
        description: The stage script's docstring.
        paths: Option name (without dashes) -> help text.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--params", default="params.yaml", help="params file")
    for name, help_text in paths.items():
        parser.add_argument(f"--{name}", required=True, help=help_text)
    return parser


def run_stage(name: str, body: Callable[[argparse.Namespace], None], parser: argparse.ArgumentParser,
              argv: Sequence[str] | None = None) -> int:
    """Parses ``argv``, runs ``body`` and turns an EaglenestError into one line on stderr and exit 2.

    Args:
        name: The stage name, shown in messages ("prepare").
        body: The stage's work, given the parsed arguments.
        parser: The stage's argument parser (paths come from dvc.yaml's command line).
        argv: Arguments; None means sys.argv[1:].

    Returns:
        The process exit status.
    """
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"eaglenest {name}: %(message)s")
    try:
        body(args)
    except EaglenestError as err:
        print(f"eaglenest {name}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"eaglenest {name}: interrupted; rerun to continue", file=sys.stderr)
        return 130
    return 0
