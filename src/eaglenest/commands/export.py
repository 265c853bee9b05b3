"""``eaglenest export --format speculators``: the pipeline's prepared rows and hidden states in speculators'
single-directory layout, one ``hs_{i}.safetensors`` per row, whatever ``extract.rows_per_shard`` stored.

The output folder is a prepare-data dataset (``data/prepared``'s files) with ``hidden_states/`` inside:
``speculators train --data-path OUT`` reads it, and ``eaglenest import --format speculators OUT`` takes it back.
Rows are copied as stored (fp8 stays fp8 with its scales), each checked against its prepared tokens.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from eaglenest.commands.command import Command
from eaglenest.core.atomic import atomic_directory, check_replaceable, mark_written_by
from eaglenest.core.errors import InputFileError
from eaglenest.core.safetensors_header import read_header

COMMAND_NAME = "eaglenest export"


def export_speculators(prepared: Path, hidden_states: Path, out: Path, force: bool = False) -> int:
    """Writes ``out`` (see the module docstring); returns the rows written.

    Args:
        prepared: The prepare stage's dataset folder.
        hidden_states: The extract stage's folder.
        out: The folder to write, replaced whole.
        force: Replace ``out`` even where it is not an earlier export.

    Raises:
        EaglenestError: ``out`` overlaps an input, or holds what export did not write and ``force`` is off.
        InputFileError: a folder that is not the pipeline's, a row missing from every file, or a row whose tokens
            differ from the prepared row (one line naming the file and row).
    """
    check_replaceable(out, {"--prepared": prepared, "--hidden-states": hidden_states}, COMMAND_NAME, force)
    # Here, not at the top: the hidden-state modules import torch, which building the parser must not.
    from safetensors import SafetensorError

    from eaglenest.artifacts.hidden_states.format import TOKENS_KEY, hs_path
    from eaglenest.artifacts.hidden_states.layout import metadata_of_row_files, write_hidden_states
    from eaglenest.artifacts.hidden_states.reader import open_stored
    from eaglenest.artifacts.prepared import load_input_ids
    from eaglenest.core.progress import progress

    if not (prepared / "dataset_info.json").is_file():
        raise InputFileError(f"--prepared {prepared}: not the prepare stage's dataset folder (data/prepared)")
    if not hidden_states.is_dir():
        raise InputFileError(f"--hidden-states {hidden_states}: no such folder (data/hidden_states)")
    input_ids = load_input_ids(prepared)
    stored = open_stored(hidden_states, len(input_ids))
    with atomic_directory(out) as tmp:
        shutil.copytree(prepared, tmp, dirs_exist_ok=True)
        target = tmp / "hidden_states"
        target.mkdir()
        for row in progress(len(input_ids), "export", "row", iterable=range(len(input_ids))):
            path = stored.path_of(row)
            if not path.is_file():
                raise InputFileError(
                    f"{hidden_states}: prepared row {row} has no hidden states ({path.name} is "
                    "missing); run `dvc repro extract`"
                )
            if stored.row_files:  # already one file per row: copied
                shutil.copyfile(path, hs_path(target, row))
                continue
            try:
                data = stored.read_row(row)
                metadata = metadata_of_row_files(read_header(path).metadata)
            except (OSError, ValueError, RuntimeError, SafetensorError, KeyError) as err:
                raise InputFileError(f"{path}: unreadable ({err}); run `dvc repro extract`") from None
            tokens = data.pop(TOKENS_KEY)
            if tokens.tolist() != input_ids[row]:
                raise InputFileError(
                    f"{stored.location(row)}: its token ids differ from the prepared row; run `dvc repro extract`"
                )
            write_hidden_states(hs_path(target, row), data, tokens, metadata)
        mark_written_by(tmp, COMMAND_NAME)
    return len(input_ids)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--format",
        required=True,
        choices=["speculators"],
        help="speculators: a prepare-data dataset with hidden_states/hs_{i}.safetensors inside, "
        "as `speculators train --data-path` reads it",
    )
    parser.add_argument(
        "--prepared", default="data/prepared", help="the prepare stage's dataset folder (default: data/prepared)"
    )
    parser.add_argument(
        "--hidden-states", default="data/hidden_states", help="the extract stage's folder (default: data/hidden_states)"
    )
    parser.add_argument(
        "--out",
        required=True,
        help="the folder to write (replaced whole, atomically); it may "
        "not hold or lie in --prepared or --hidden-states",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace --out even where it is not an earlier export (a folder of yours is deleted)",
    )


def _run(args: argparse.Namespace) -> int:
    rows = export_speculators(Path(args.prepared), Path(args.hidden_states), Path(args.out), args.force)
    print(
        f"exported {rows} rows to {args.out} (hs_{{i}}.safetensors in {args.out}/hidden_states); train on it with "
        f"`speculators train --data-path {args.out}`"
    )
    return 0


COMMAND = Command(
    "export",
    help="write the prepared rows and their hidden states in speculators' layout, one "
    "hs_{i}.safetensors per row (from shards or row files)",
    add_arguments=_add_arguments,
    run=_run,
)
