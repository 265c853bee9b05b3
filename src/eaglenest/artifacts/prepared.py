"""The prepared dataset: what the prepare stage writes and extract, convert, train and evaluate read.

A ``datasets`` ``save_to_disk`` folder in speculators' ``prepare-data`` schema (``input_ids``, ``loss_mask``
int64 lists, ``seq_len``), train rows first and validation rows last, so speculators' ``ArrowDataset`` opens it;
beside it ``split.json`` (row counts and the ``train_ratio`` that reproduces the split in speculators),
``val_prompts.jsonl`` (each validation conversation up to its first user turn, for evaluation prompts), only with a
``traffic:<dir>`` source ``traffic_held_out.jsonl`` (its held-out requests, never trained on) and, only
with ``prepare.reasoning`` set, ``chat_template_kwargs.json`` (how the rows were rendered, so evaluation renders
its prompts the same way).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from eaglenest.core.atomic import atomic_directory, atomic_write_bytes, atomic_write_json
from eaglenest.core.errors import EaglenestError

SPLIT_FILE = "split.json"


VAL_PROMPTS_FILE = "val_prompts.jsonl"


# Written only with a traffic:<dir> source: its held-out slice, the evaluate set source: traffic.
TRAFFIC_HELD_OUT_FILE = "traffic_held_out.jsonl"


# Written only with prepare.reasoning set: the chat-template arguments the rows were rendered with, so the
# evaluate stage renders its prompts the same way.
CHAT_FILE = "chat_template_kwargs.json"


def write_prepared(
    out_dir: Path,
    input_ids: list[list[int]],
    loss_mask: list[list[int]],
    train_rows: int,
    val_prompts: list[dict[str, Any]],
    chat_kwargs: dict[str, Any] | None = None,
    in_place: bool = False,
    traffic_held_out: list[dict[str, Any]] | None = None,
) -> None:
    """Writes the prepared dataset (speculators' schema, torch format), split.json and val_prompts.jsonl, and
    the chat-template arguments when there are any.

    Args:
        out_dir: The dataset's folder: replaced whole, or left as it was where writing fails.
        input_ids: Token ids of every row, train rows first.
        loss_mask: 1 where a row's token carries the loss, row by row.
        train_rows: How many of the rows are train rows; the rest are validation rows.
        val_prompts: The validation conversations up to their first user turn, one record each.
        chat_kwargs: The chat-template arguments the rows were rendered with (``prepare.reasoning``), if any.
        in_place: Write into ``out_dir`` as it is, a folder the caller fills further and renames itself
            (``eaglenest import`` stores the hidden states beside the rows).
        traffic_held_out: The traffic source's held-out requests as evaluation records, if it has one.
    """
    from datasets import Dataset, Features, Sequence, Value

    with contextlib.nullcontext(Path(out_dir)) if in_place else atomic_directory(out_dir) as directory:
        features = Features(
            {"input_ids": Sequence(Value("int64")), "loss_mask": Sequence(Value("int64")), "seq_len": Value("int64")}
        )
        dataset = Dataset.from_dict(
            {"input_ids": input_ids, "loss_mask": loss_mask, "seq_len": [len(ids) for ids in input_ids]},
            features=features,
        )
        dataset.set_format(type="torch")  # speculators' ArrowDataset indexes rows as tensors
        dataset.save_to_disk(str(directory))
        # speculators splits with split_idx = int(len * train_ratio); the +0.5 keeps float error out.
        atomic_write_json(
            directory / SPLIT_FILE,
            {
                "train_rows": train_rows,
                "val_rows": len(input_ids) - train_rows,
                "train_ratio": (train_rows + 0.5) / len(input_ids),
            },
        )
        lines = "".join(json.dumps(prompt) + "\n" for prompt in val_prompts)
        atomic_write_bytes(directory / VAL_PROMPTS_FILE, lines.encode())
        if chat_kwargs:
            atomic_write_json(directory / CHAT_FILE, chat_kwargs)
        if traffic_held_out is not None:
            held = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in traffic_held_out)
            atomic_write_bytes(directory / TRAFFIC_HELD_OUT_FILE, held.encode())


def load_chat_kwargs(prepared_dir: Path) -> dict[str, Any]:
    """The chat-template arguments prepare rendered with (``prepare.reasoning``), or none."""
    path = Path(prepared_dir) / CHAT_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def load_split(prepared_dir: Path) -> dict[str, Any]:
    """The train/val row counts written by prepare."""
    path = Path(prepared_dir) / SPLIT_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise EaglenestError(f"{path} does not exist; run the prepare stage first (`dvc repro prepare`)") from None


def load_table(prepared_dir: Path) -> Any:
    """The prepared dataset's Arrow table (columns ``input_ids``, ``loss_mask``, ``seq_len``).

    Raises:
        EaglenestError: there is no dataset in ``prepared_dir`` (one line, with the fix).
    """
    from datasets import load_from_disk

    try:
        return load_from_disk(str(prepared_dir)).data
    except FileNotFoundError:
        raise EaglenestError(f"{prepared_dir}: no prepared dataset; run `dvc repro prepare` first") from None


def load_input_ids(prepared_dir: Path) -> list[list[int]]:
    """Token ids of every prepared row, in row order."""
    return load_table(prepared_dir).column("input_ids").to_pylist()
