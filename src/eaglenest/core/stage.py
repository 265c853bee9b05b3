"""The stage contract: every stage is a :class:`Stage`, and every ``stages/<name>.py`` script is the same lines.

A stage package (``eaglenest.stages.<name>``) defines ``STAGE = Stage(name, description, params, paths, run)``:

* ``params`` is the :class:`~eaglenest.core.params.StageParams` of what the stage reads of params.yaml (its own
  section and the shared ones, from ``eaglenest.stages.<name>.params``): the stage validates those sections and no
  others, so an edit to another stage's schema or section neither re-runs nor stops it.
* ``paths`` is a frozen dataclass of where dvc.yaml puts the stage's inputs and outputs. Each field made with
  :func:`path_arg` becomes a required ``--<field-name>`` option of the script (underscores as dashes); fields
  without it are not on the command line (their defaults serve tests). The inputs another stage wrote come from
  the base it derives from (:class:`VerifierInput` ... :class:`DraftInput`), which describes each once.
* ``run(params, paths) -> metrics`` gets those typed sections (``params.train``, ``params.cluster``) and returns
  the metrics it wrote (empty for a stage without metrics).

:func:`run_stage` parses the command line, loads and validates the stage's sections of params.yaml, runs the
stage, and turns an :class:`~eaglenest.core.errors.EaglenestError` into one line on stderr and exit status 2.
Every log line carries one prefix, ``eaglenest <stage>:``; a message never repeats the stage's name. SIGTERM (a
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
from eaglenest.core.params import StageParams, load_sections

P = TypeVar("P")
S = TypeVar("S", bound=StageParams)

_HELP = "eaglenest_help"
_KIND = "eaglenest_kind"


def path_arg(help_text: str) -> Any:
    """A paths-dataclass field that dvc.yaml passes as a required ``--<name> PATH``."""
    return dataclasses.field(metadata={_HELP: help_text, _KIND: "path"})


# The folders one stage writes and later stages read, each described once. A stage's paths dataclass derives from
# the one that holds what it reads: the fields come first, in the pipeline's order, then the stage's own.
@dataclass(frozen=True)
class VerifierInput:
    """Reads the verifier stage's output."""

    verifier: Path = path_arg("the verifier stage's output folder")


@dataclass(frozen=True)
class PreparedInput(VerifierInput):
    """Reads the verifier and the prepare stage's dataset."""

    prepared: Path = path_arg("the prepare stage's dataset folder")


@dataclass(frozen=True)
class HiddenStatesInput(PreparedInput):
    """Reads the verifier, the prepared dataset and the extract stage's hidden states."""

    hidden_states: Path = path_arg("the extract stage's folder")


@dataclass(frozen=True)
class VocabInput(HiddenStatesInput):
    """Reads all the data stages' outputs, up to the convert stage's vocabulary."""

    vocab: Path = path_arg("the convert stage's vocabulary folder")


@dataclass(frozen=True)
class DraftInput(PreparedInput):
    """Reads the verifier, the prepared dataset (its chat-template switches, its held-out prompts) and the train
    stage's draft."""

    draft: Path = path_arg("the train stage's draft checkpoint")


@dataclass(frozen=True)
class Stage(Generic[S, P]):
    """One pipeline stage.

    Attributes:
        name: The stage's name in dvc.yaml ("train"), shown in every message.
        description: One line: what the stage does (the script's ``--help``).
        params: What the stage reads of params.yaml: its own section and the shared ones.
        paths: The frozen dataclass of the stage's paths.
        run: ``(params, paths) -> metrics``: the stage's work.
    """

    name: str
    description: str
    params: type[S]
    paths: type[P]
    run: Callable[[S, P], dict[str, Any]]


def stage_parser(stage: Stage[Any, Any]) -> argparse.ArgumentParser:
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


def run_stage(stage: Stage[Any, Any], argv: Sequence[str] | None = None) -> int:
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
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s eaglenest {stage.name}: %(message)s", datefmt="%Y-%m-%d %H:%M:%S"
    )
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        stage.run(load_sections(params_file, stage.params), stage.paths(**args))
    except EaglenestError as err:
        print(f"eaglenest {stage.name}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"eaglenest {stage.name}: interrupted; rerun to continue", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)  # a caller's own handler (a test runner's) is its again
    return 0
