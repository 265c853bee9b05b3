"""``eaglenest export --format speculators``: the pipeline's prepared rows and hidden states in speculators'
single-directory layout, one ``hs_{i}.safetensors`` per row, whatever ``extract.rows_per_shard`` stored.

The output folder is a prepare-data dataset (``data/prepared``'s files) with ``hidden_states/`` inside:
``speculators train --data-path OUT`` reads it, and ``eaglenest import --format speculators OUT`` takes it back.
Rows are copied as stored (fp8 stays fp8 with its scales), each checked against its prepared tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors import SafetensorError, safe_open

from eaglenest.artifacts.hidden_states import (
    METADATA_KEY,
    TOKENS_KEY,
    hs_path,
    read_shard_row,
    shard_number,
    shard_row_index,
    write_hidden_states,
)
from eaglenest.artifacts.prepared import load_input_ids
from eaglenest.core.atomic import atomic_directory
from eaglenest.core.errors import InputFileError
from eaglenest.core.progress import progress
from eaglenest.core.safetensors_header import read_header


def _row_metadata(shard: Path) -> dict[str, str]:
    """A shard's metadata as a row file's: its size and number dropped."""
    info = json.loads(read_header(shard).metadata.get(METADATA_KEY, "{}"))
    info.pop("rows_per_shard", None)
    info.pop("shard", None)
    return {METADATA_KEY: json.dumps(info, sort_keys=True)}


def export_speculators(prepared: Path, hidden_states: Path, out: Path) -> int:
    """Writes ``out`` (see the module docstring); returns the rows written.

    Raises:
        InputFileError: a folder that is not the pipeline's, a row missing from every file, or a row whose tokens
            differ from the prepared row (one line naming the file and row).
    """
    if not (prepared / "dataset_info.json").is_file():
        raise InputFileError(f"--prepared {prepared}: not the prepare stage's dataset folder (data/prepared)")
    if not hidden_states.is_dir():
        raise InputFileError(f"--hidden-states {hidden_states}: no such folder (data/hidden_states)")
    input_ids = load_input_ids(prepared)
    shards = sorted((p for p in hidden_states.glob("shard_*.safetensors") if shard_number(p) is not None),
                    key=shard_number)
    written = set()
    with atomic_directory(out) as tmp:
        shutil.copytree(prepared, tmp, dirs_exist_ok=True)
        target = tmp / "hidden_states"
        target.mkdir()
        if shards:
            for shard in progress(len(shards), "export", "shard", iterable=shards):
                metadata = _row_metadata(shard)
                try:
                    index = shard_row_index(shard)
                    with safe_open(str(shard), framework="pt") as handle:
                        for row, (first, length) in sorted(index.items()):
                            data = read_shard_row(handle, first, length)
                            tokens = data.pop(TOKENS_KEY)
                            if row >= len(input_ids) or tokens.tolist() != input_ids[row]:
                                raise InputFileError(f"{shard} row {row}: its token ids differ from the prepared "
                                                     "row; run `dvc repro extract`")
                            write_hidden_states(hs_path(target, row), data, tokens, metadata)
                            written.add(row)
                except (OSError, ValueError, RuntimeError, SafetensorError, KeyError) as err:
                    raise InputFileError(f"{shard}: unreadable ({err}); run `dvc repro extract`") from None
        else:  # already one file per row: copied
            for row in progress(len(input_ids), "export", "row", iterable=range(len(input_ids))):
                if hs_path(hidden_states, row).is_file():
                    shutil.copyfile(hs_path(hidden_states, row), hs_path(target, row))
                    written.add(row)
        missing = [row for row in range(len(input_ids)) if row not in written]
        if missing:
            raise InputFileError(f"{hidden_states}: {len(missing)} prepared rows have no hidden states (first: row "
                                 f"{missing[0]}); run `dvc repro extract`")
    return len(written)
