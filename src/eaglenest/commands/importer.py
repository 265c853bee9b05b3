"""``eaglenest import``: hidden states dumped by other tools, turned into eaglenest's layout.

The output folder is speculators' single-directory layout — a prepare-data dataset (``input_ids``,
``loss_mask``, ``seq_len``) with ``hidden_states/hs_{i}.safetensors`` inside — which the pipeline takes
with ``prepare.source: [import:DST]``, ``extract.backend: import`` and ``extract.import_path:
DST/hidden_states``.

Formats (a registry; ``eaglenest import --help`` lists them):

* ``speculators-pt`` — the older speculators offline format: one ``.pt`` per sample with ``input_ids``
  ``[seq]`` int64, ``hidden_states`` a list of n_aux+1 ``[seq, hidden]`` tensors and ``loss_mask``
  ``[seq]``. Read with ``torch.load(weights_only=True)``: a file carrying pickled objects is refused.
* ``speculators`` — speculators 0.9 / vLLM: ``hs_{i}.safetensors`` in ``SRC/hidden_states`` (or ``SRC``)
  next to a prepare-data dataset in ``SRC``.
"""

from __future__ import annotations

import argparse
import logging
import pickle
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from eaglenest.commands.command import Command
from eaglenest.core.atomic import atomic_directory, check_replaceable, mark_written_by
from eaglenest.core.errors import InputFileError
from eaglenest.core.registry import Registry

# torch, safetensors and the hidden-state modules (which import torch) are imported in the functions that read
# and write tensors, so that building the command line's parser does not import torch.
if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# input_ids, loss_mask, and the stored hidden-state tensors: hidden_states [seq, slots, hidden] (+ fp8 scales)
Sample = tuple[list[int], list[int], dict[str, "torch.Tensor"]]


def _natural_key(path: Path) -> tuple:
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name))


def load_pt_sample(path: Path) -> Sample:
    """One speculators-pt sample, checked; never unpickles arbitrary objects."""
    import torch

    from eaglenest.artifacts.hidden_states.format import HIDDEN_KEY

    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else "unsupported object"
        raise InputFileError(
            f"{path}: refused: holds pickled objects that torch.load(weights_only=True) will not load ({first_line})"
        ) from None
    except (OSError, RuntimeError, EOFError) as err:
        raise InputFileError(f"{path}: not a readable .pt file: {err}") from None
    if not isinstance(data, dict):
        raise InputFileError(
            f"{path}: expected a dict with input_ids, hidden_states, loss_mask; got {type(data).__name__}"
        )
    missing = {"input_ids", "hidden_states", "loss_mask"} - data.keys()
    if missing:
        raise InputFileError(f"{path}: missing key(s) {sorted(missing)}; has {sorted(data)}")
    input_ids, layers, loss_mask = data["input_ids"], data["hidden_states"], data["loss_mask"]
    if not (isinstance(input_ids, torch.Tensor) and input_ids.dim() == 1):
        raise InputFileError(f"{path}: input_ids must be a 1-D tensor")
    seq = input_ids.numel()
    if not (isinstance(loss_mask, torch.Tensor) and loss_mask.shape == (seq,)):
        raise InputFileError(f"{path}: loss_mask must be a [{seq}] tensor")
    if not (isinstance(layers, (list, tuple)) and layers and all(isinstance(t, torch.Tensor) for t in layers)):
        raise InputFileError(f"{path}: hidden_states must be a list of [seq, hidden] tensors")
    shapes = {tuple(t.shape) for t in layers}
    if len(shapes) != 1 or next(iter(shapes))[0] != seq or len(next(iter(shapes))) != 2:
        raise InputFileError(f"{path}: hidden_states tensors have shapes {sorted(shapes)}, expected [{seq}, hidden]")
    return input_ids.long().tolist(), loss_mask.long().tolist(), {HIDDEN_KEY: torch.stack(list(layers), dim=1)}


def read_speculators_pt(source: Path) -> Iterator[Sample]:
    files = sorted(source.glob("*.pt"), key=_natural_key)
    if not files:
        raise InputFileError(f"{source}: no .pt files")
    for path in files:
        yield load_pt_sample(path)


def read_speculators(source: Path) -> Iterator[Sample]:
    from datasets import load_from_disk
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from eaglenest.artifacts.hidden_states.format import HIDDEN_KEY, SCALES_KEY, TOKENS_KEY, hs_path

    try:
        table = load_from_disk(str(source)).data
    except FileNotFoundError:
        raise InputFileError(f"{source}: not a speculators prepare-data dataset folder") from None
    hs_dir = source / "hidden_states" if (source / "hidden_states").is_dir() else source
    ids_column, mask_column = table.column("input_ids"), table.column("loss_mask")
    for row in range(table.num_rows):
        path = hs_path(hs_dir, row)
        try:
            data = load_file(path)
        except FileNotFoundError:
            raise InputFileError(f"{path}: missing (row {row} of {source})") from None
        except (OSError, SafetensorError) as err:
            raise InputFileError(f"{path}: unreadable: {err}") from None
        if HIDDEN_KEY not in data or TOKENS_KEY not in data:
            raise InputFileError(f"{path}: has keys {sorted(data)}, expected {HIDDEN_KEY} and {TOKENS_KEY}")
        input_ids = ids_column[row].as_py()
        if data[TOKENS_KEY].tolist() != input_ids:
            raise InputFileError(f"{path}: token_ids differ from row {row}'s input_ids in {source}")
        # fp8 files keep their bytes and scales: nothing is requantized on the way in.
        yield input_ids, mask_column[row].as_py(), {k: v for k, v in data.items() if k in (HIDDEN_KEY, SCALES_KEY)}


IMPORT_FORMATS: Registry[Callable[[Path], Iterator[Sample]]] = Registry("import format")
IMPORT_FORMATS.register("speculators-pt", read_speculators_pt)
IMPORT_FORMATS.register("speculators", read_speculators)


COMMAND_NAME = "eaglenest import"


def import_dump(fmt: str, source: Path, out: Path, val_fraction: float = 0.05, force: bool = False) -> dict[str, int]:
    """Converts ``source`` (in format ``fmt``) into ``out``; returns counts. ``out`` appears only when complete.

    Args:
        fmt: An import format's name (``IMPORT_FORMATS``).
        source: The dump.
        out: The folder to write, replaced whole.
        val_fraction: The fraction of rows, last ones, held out for validation.
        force: Replace ``out`` even where it is not an earlier import.

    Raises:
        EaglenestError: ``out`` overlaps ``source``, or holds what import did not write and ``force`` is off.
        InputFileError: an unknown format, or a dump that cannot be read (one line naming the file).
    """
    check_replaceable(out, {"the source": source}, COMMAND_NAME, force)
    import torch
    from tqdm import tqdm

    from eaglenest.artifacts.hidden_states.format import HIDDEN_KEY, decode_hidden_states, hs_path
    from eaglenest.artifacts.hidden_states.layout import write_hidden_states
    from eaglenest.artifacts.prepared import write_prepared

    if fmt not in IMPORT_FORMATS:
        raise InputFileError(f"unknown format {fmt!r}; known: {', '.join(IMPORT_FORMATS.names())}")
    if not source.exists():
        raise InputFileError(f"{source}: no such file or folder")
    all_ids: list[list[int]] = []
    all_masks: list[list[int]] = []
    slots = hidden = None
    with atomic_directory(out) as tmp:
        hs_dir = tmp / "hidden_states"
        for row, (input_ids, loss_mask, stored) in enumerate(tqdm(IMPORT_FORMATS.get(fmt)(source), desc="import")):
            states = stored[HIDDEN_KEY]
            if slots is None:
                slots, hidden = states.shape[1], states.shape[2]
            elif states.shape[1:] != (slots, hidden):
                raise InputFileError(
                    f"{source}: sample {row} has {tuple(states.shape[1:])} layers x hidden, "
                    f"sample 0 has ({slots}, {hidden})"
                )
            if not bool(torch.isfinite(decode_hidden_states(stored)).all()):
                raise InputFileError(f"{source}: sample {row} has non-finite hidden states")
            write_hidden_states(hs_path(hs_dir, row), stored, torch.tensor(input_ids), {})
            all_ids.append(input_ids)
            all_masks.append(loss_mask)
        if len(all_ids) < 2:
            raise InputFileError(f"{source}: {len(all_ids)} samples; need at least 2")
        train_rows = max(1, len(all_ids) - max(1, round(len(all_ids) * val_fraction)))
        write_prepared(tmp, all_ids, all_masks, train_rows, [], in_place=True)
        mark_written_by(tmp, COMMAND_NAME)
    return {"samples": len(all_ids), "layers": int(slots or 0), "hidden_size": int(hidden or 0)}


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--format",
        required=True,
        choices=IMPORT_FORMATS.names(),
        help="speculators-pt (one .pt per sample) or speculators (0.9 / vLLM hs_{i}.safetensors)",
    )
    parser.add_argument("source", help="the dump (a folder)")
    parser.add_argument(
        "--out",
        required=True,
        help="output folder: a dataset with hidden_states/ inside "
        "(replaced whole, atomically); it may not hold or lie in the source",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace --out even where it is not an earlier import (a folder of yours is deleted)",
    )
    parser.add_argument("--val-fraction", type=float, default=0.05, help="last rows held out for validation")


def _run(args: argparse.Namespace) -> int:
    counts = import_dump(args.format, Path(args.source), Path(args.out), args.val_fraction, args.force)
    print(
        f"imported {counts['samples']} samples ({counts['layers']} layers x {counts['hidden_size']}) into "
        f"{args.out}\nuse it with params: prepare.source: [import:{args.out}], extract.backend: import, "
        f"extract.import_path: {args.out}/hidden_states"
    )
    return 0


COMMAND = Command(
    "import",
    help="turn hidden states dumped by other tools into eaglenest's layout",
    add_arguments=_add_arguments,
    run=_run,
)
