"""What an ``eaglenest`` command declares: its name, its help, its arguments and what it runs.

Each command's module defines one ``COMMAND = Command(...)``; ``commands/cli.py`` lists the modules in the order
``eaglenest --help`` shows them, registers each ``COMMAND`` (a name given twice is refused) and builds the parser
from them. A command module imports only the standard library and eaglenest's light modules at its top, and
third-party packages inside its functions, so that building the parser, and ``eaglenest doctor``, run in an
interpreter without them. Where the work needs them at its top (``report``, ``init``, ``train_launch``), the
declaration sits in a companion module, ``<name>_command.py``, that imports the work when the command runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """One ``eaglenest`` subcommand.

    Attributes:
        name: What follows ``eaglenest`` on the command line.
        help: The one line ``eaglenest --help`` lists it with.
        add_arguments: Adds the command's arguments to its subparser (a command with actions of its own, like
            ``remote``, adds each action as a ``Command`` of its own subparser).
        run: Runs the command on the parsed arguments (with ``passthrough_args``, the flags after ``--``); the exit
            status. An ``EaglenestError`` it raises becomes one line and exit status 2.
        description: The opening of ``eaglenest NAME --help``; None: ``help`` as a sentence.
        passes_flags: Flags after ``--`` go on (to vLLM, or to DVC); any other command refuses them. A command
            with actions narrows it per action (``passes_flags`` set in the action's parsed arguments).
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str | None = None
    passes_flags: bool = False

    @property
    def sentence(self) -> str:
        """The description ``--help`` opens with: the given one, else the one-line help as a sentence."""
        return self.description or self.help[:1].upper() + self.help[1:].rstrip(".") + "."
