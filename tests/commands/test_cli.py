"""The ``eaglenest`` command's help reads as help: a description for the program and for every command, and the
allowed values of a choice listed (the import formats equal to what the importer registers)."""

from __future__ import annotations

import argparse

from eaglenest.commands import cli
from eaglenest.commands.importer import IMPORT_FORMATS


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
    assert sorted(cli.IMPORT_FORMAT_NAMES) == sorted(IMPORT_FORMATS.names())
    importer = _subparsers(cli.build_parser())["import"]
    assert "{speculators-pt,speculators}" in importer.format_usage()
