"""The ``eaglenest`` command's help reads as help: a description for the program and for every command, and the
allowed values of a choice listed (the import formats equal to what the importer registers)."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import subprocess
import sys

import pytest

from eaglenest import commands
from eaglenest.commands import bench, cli
from eaglenest.commands.importer import IMPORT_FORMATS
from tests.fixtures.pipeline import REPO


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_command_opens_its_help_with_a_description():
    parser = cli.build_parser()
    assert "trains EAGLE-3" in parser.description and "``" not in parser.format_help()
    for name, sub in _subparsers(parser).items():
        assert sub.description and sub.description[0].isupper() and sub.description.endswith("."), name
        assert "``" not in sub.format_help(), name


def test_import_lists_the_formats_the_importer_registers():
    importer = _subparsers(cli.build_parser())["import"]
    assert f"--format {{{','.join(IMPORT_FORMATS.names())}}}" in importer.format_usage()


def test_every_command_module_is_registered_once_in_the_order_of_the_help():
    """A module that declares a COMMAND but is missing from COMMAND_MODULES would be a command nobody can run; the
    parser lists exactly the registered commands, in COMMAND_MODULES' order."""
    declaring = {
        info.name
        for info in pkgutil.walk_packages(commands.__path__, "eaglenest.commands.")
        if hasattr(importlib.import_module(info.name), "COMMAND")
    }
    assert declaring == {module.__name__ for module in cli.COMMAND_MODULES}
    names = [module.COMMAND.name for module in cli.COMMAND_MODULES]
    assert list(_subparsers(cli.build_parser())) == names and sorted(names) == cli.COMMANDS.names()
    with pytest.raises(ValueError, match="command 'bench' is already registered"):
        cli.COMMANDS.register("bench", bench.COMMAND)


def test_the_parser_builds_in_an_interpreter_without_third_party_packages():
    """`eaglenest --help` and `eaglenest doctor` must run where torch, vLLM, even numpy or yaml are missing or
    broken: the command modules import them only when a command runs (python -S: no site-packages at all)."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from eaglenest.commands.cli import build_parser; "
        "build_parser(); print('built')"
    )
    done = subprocess.run([sys.executable, "-S", "-c", code, str(REPO / "src")], capture_output=True, text=True)
    assert done.stdout.strip() == "built", done.stderr[-2000:]
