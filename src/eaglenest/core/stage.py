"""The stage contract: every stage is a :class:`Stage`, and every ``stages/<name>.py`` script is the same lines.

A stage package (``eaglenest.stages.<name>``) defines ``STAGE = Stage(name, paths, run)``:

* ``paths`` is a frozen dataclass of where dvc.yaml puts the stage's inputs and outputs. Each field made with
  :func:`path_arg` becomes a required ``--<field-name>`` option of the script (underscores as dashes); fields
  without it are not on the command line (their defaults serve tests).
* ``run(params, paths) -> metrics`` gets the whole typed params file, so a stage reads ``params.extract.dtype``
  itself, and returns the metrics it wrote (empty for a stage without metrics).

:func:`run_stage` parses the command line, loads and validates params.yaml, runs the stage, and turns an
:class:`~eaglenest.core.errors.EaglenestError` into one line on stderr and exit status 2. SIGTERM (a
scheduler's time limit, ``kill``, ``timeout``) interrupts a stage as Ctrl-C does: the interpreter unwinds, so
a vLLM engine's own processes are shut down with it instead of outliving it, and the stage exits 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from eaglenest.core.errors import EaglenestError
from eaglenest.core.params import Params, load_params

P = TypeVar("P")

_HELP = "eaglenest_help"
_KIND = "eaglenest_kind"


def path_arg(help_text: str) -> Any:
    """A paths-dataclass field that dvc.yaml passes as a required ``--<name> PATH``."""
    return dataclasses.field(metadata={_HELP: help_text, _KIND: "path"})


@dataclass(frozen=True)
class Stage(Generic[P]):
    """One pipeline stage.

    Attributes:
        name: The stage's name in dvc.yaml ("train"), shown in every message.
        description: One line: what the stage does (the script's ``--help``).
        paths: The frozen dataclass of the stage's paths.
        run: ``(params, paths) -> metrics``: the stage's work.
    """

    name: str
    description: str
    paths: type[P]
    run: Callable[[Params, P], dict[str, Any]]


def stage_parser(stage: Stage[Any]) -> argparse.ArgumentParser:
    """The stage script's parser: ``--params`` plus one option per :func:`path_arg` field."""
    parser = argparse.ArgumentParser(prog=f"stages/{stage.name}.py", description=stage.description)
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    for field in dataclasses.fields(stage.paths):
        kind = field.metadata.get(_KIND)
        option = "--" + field.name.replace("_", "-")
        if kind == "path":
            parser.add_argument(option, dest=field.name, type=Path, required=True, help=field.metadata[_HELP])
    return parser


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM as Ctrl-C: Python's default for SIGTERM ends the process at once, without unwinding, so the
    engine processes vLLM started (its engine core, its workers) would keep running, and computing."""
    raise KeyboardInterrupt


def run_stage(stage: Stage[Any], argv: Sequence[str] | None = None) -> int:
    """Parses ``argv``, runs the stage and returns the process exit status.

    Args:
        stage: The stage.
        argv: Arguments; None means ``sys.argv[1:]``.

    Returns:
        0 on success; 2 after one line naming what the user must fix; 130 when interrupted (a rerun continues).
    """
    args = vars(stage_parser(stage).parse_args(argv))
    params_file = args.pop("params")
    # Timestamped: a log of hours (training, extraction at scale) says when each line was written.
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s eaglenest {stage.name}: %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S")
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        stage.run(load_params(params_file), stage.paths(**args))
    except EaglenestError as err:
        print(f"eaglenest {stage.name}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"eaglenest {stage.name}: interrupted; rerun to continue", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)  # a caller's own handler (a test runner's) is its again
    return 0
