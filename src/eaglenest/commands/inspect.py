"""``eaglenest inspect PATH``: what is in a dump, before anyone writes code against it.

Handles a safetensors file (hidden states or weights), a ``.pt`` file (loaded with ``weights_only=True``),
a checkpoint folder (``config.json`` + safetensors), a ``datasets.save_to_disk`` folder, and a folder of
any of these (one file described in full, the rest summarised from their headers).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eaglenest.commands.command import Command
from eaglenest.core.errors import InputFileError
from eaglenest.core.safetensors_header import read_header

# torch and the hidden-state format (which imports torch) are imported in the functions that read tensors, so
# that building the command line's parser does not import torch.
if TYPE_CHECKING:
    import torch

MAX_TENSORS_LISTED = 40


def _stats(tensor: torch.Tensor) -> str:
    import torch

    if tensor.numel() == 0:
        return "empty"
    values = tensor.float()
    finite = torch.isfinite(values)
    text = ""
    if not bool(finite.all()):
        text = f"{int((~finite).sum())} non-finite, "
        values = values[finite]
    if values.numel() == 0:
        return text + "no finite values"
    return text + (
        f"min {values.min().item():.4g}, max {values.max().item():.4g}, "
        f"mean {values.mean().item():.4g}, std {values.std().item() if values.numel() > 1 else 0:.4g}"
    )


def _describe_tensor(name: str, tensor: torch.Tensor) -> str:
    return f"  {name}: {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}  {_stats(tensor)}"


def _describe_tree(name: str, value: Any, depth: int = 0) -> list[str]:
    import torch

    pad = "  " * depth
    if isinstance(value, torch.Tensor):
        return [pad + _describe_tensor(name, value).strip()]
    if isinstance(value, dict):
        lines = [f"{pad}{name}: dict with {len(value)} keys"]
        for key, item in list(value.items())[:MAX_TENSORS_LISTED]:
            lines += _describe_tree(str(key), item, depth + 1)
        return lines
    if isinstance(value, (list, tuple)):
        lines = [f"{pad}{name}: {type(value).__name__} of {len(value)}"]
        for i, item in enumerate(value[:8]):
            lines += _describe_tree(f"[{i}]", item, depth + 1)
        return lines
    return [f"{pad}{name}: {type(value).__name__} = {value!r:.80}"]


def describe_safetensors(path: Path) -> list[str]:
    import torch
    from safetensors.torch import load_file

    from eaglenest.artifacts.hidden_states.format import (
        HIDDEN_KEY,
        ROW_INDEX_KEY,
        SCALES_KEY,
        TOKENS_KEY,
        decode_hidden_states,
    )

    header = read_header(path)
    lines = [f"{path}: safetensors, {header.actual_size:,} bytes"]
    if header.actual_size != header.expected_size:
        lines.append(f"  TRUNCATED: header promises {header.expected_size:,} bytes")
        return lines + [f"  {n}: {d} {s}" for n, (d, s) in header.tensors.items()]
    if header.metadata:
        lines.append(f"  metadata: {json.dumps(header.metadata)[:300]}")
    if HIDDEN_KEY in header.tensors and ROW_INDEX_KEY in header.tensors:
        return lines + describe_shard(path)
    if HIDDEN_KEY in header.tensors:  # a hidden-state file: per-slot statistics
        data = load_file(path)
        stored = data[HIDDEN_KEY]
        hidden = decode_hidden_states(data)  # statistics of the values training sees (fp8: dequantized)
        dtype = str(stored.dtype).removeprefix("torch.")
        lines.append(
            f"  {HIDDEN_KEY}: {dtype} {list(stored.shape)}  {_stats(hidden)}"
            + (f"  (dequantized with {SCALES_KEY})" if SCALES_KEY in data else "")
        )
        if hidden.dim() == 3:
            for slot in range(hidden.shape[1]):
                lines.append(f"    slot {slot}: {_stats(hidden[:, slot])}")
        if TOKENS_KEY in data:
            tokens = data[TOKENS_KEY]
            lines.append(_describe_tensor(TOKENS_KEY, tokens) + f"  ({tokens.numel()} tokens)")
        for name in sorted(set(data) - {HIDDEN_KEY, TOKENS_KEY}):
            lines.append(_describe_tensor(name, data[name]))
        return lines
    total = 0
    for i, (name, (dtype, shape)) in enumerate(sorted(header.tensors.items())):
        total += int(torch.tensor(shape).prod().item()) if shape else 1
        if i < MAX_TENSORS_LISTED:
            lines.append(f"  {name}: {dtype} {shape}")
    if len(header.tensors) > MAX_TENSORS_LISTED:
        lines.append(f"  ... {len(header.tensors) - MAX_TENSORS_LISTED} more tensors")
    lines.append(f"  {len(header.tensors)} tensors, {total:,} values")
    return lines


def describe_shard(path: Path) -> list[str]:
    """A hidden-state shard: its rows and their lengths from the row index, whether the index tiles the tensors,
    and the first row's per-slot statistics (one row read, whatever the shard's size)."""
    from safetensors import safe_open

    from eaglenest.artifacts.hidden_states.format import (
        HIDDEN_KEY,
        ROW_INDEX_KEY,
        SCALES_KEY,
        decode_hidden_states,
        read_shard_row,
    )

    with safe_open(str(path), framework="pt") as handle:
        index = handle.get_tensor(ROW_INDEX_KEY)  # [rows, 3]: row, first token, length
        stored_tokens = handle.get_slice(HIDDEN_KEY).get_shape()[0]
        rows, lengths = index[:, 0].tolist(), index[:, 2].tolist()
        lines = [
            f"  shard of {len(rows)} rows ({rows[0]}..{rows[-1]}), {sum(lengths):,} tokens; row length min "
            f"{min(lengths)}, mean {sum(lengths) / len(lengths):.1f}, max {max(lengths)}"
        ]
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        contiguous = rows == list(range(rows[0], rows[0] + len(rows))) and index[:, 1].tolist() == starts
        if not contiguous or sum(lengths) != stored_tokens:
            lines.append(
                f"  ROW INDEX DISAGREES with the tensors: {ROW_INDEX_KEY} covers {sum(lengths)} tokens of "
                f"{stored_tokens}" + ("" if contiguous else ", rows or offsets not consecutive")
            )
            return lines
        data = read_shard_row(handle, int(index[0, 1]), int(index[0, 2]))
    hidden = decode_hidden_states(data)
    lines.append(
        f"  row {rows[0]}: {HIDDEN_KEY} {str(data[HIDDEN_KEY].dtype).removeprefix('torch.')} "
        f"{list(hidden.shape)}  {_stats(hidden)}" + (f"  (dequantized with {SCALES_KEY})" if SCALES_KEY in data else "")
    )
    lines += [f"    slot {slot}: {_stats(hidden[:, slot])}" for slot in range(hidden.shape[1])]
    return lines


def describe_pt(path: Path) -> list[str]:
    import pickle

    import torch

    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise InputFileError(f"{path}: refused: pickled objects that weights_only=True will not load ({err})") from None
    return [f"{path}: torch file, {path.stat().st_size:,} bytes", *_describe_tree("contents", data, 1)]


def describe_dataset(path: Path) -> list[str]:
    from datasets import load_from_disk

    table = load_from_disk(str(path)).data
    lines = [f"{path}: dataset, {table.num_rows} rows, columns {table.column_names}"]
    if "input_ids" in table.column_names:
        lengths = [len(ids) for ids in table.column("input_ids").to_pylist()]
        lines.append(
            f"  tokens {sum(lengths):,}; seq_len min {min(lengths)}, mean {sum(lengths) / len(lengths):.1f}, "
            f"max {max(lengths)}"
        )
    if "loss_mask" in table.column_names:
        lines.append(f"  loss tokens {sum(sum(m) for m in table.column('loss_mask').to_pylist()):,}")
    return lines


def describe_checkpoint(path: Path) -> list[str]:
    config = json.loads((path / "config.json").read_text())
    keys = (
        "speculators_model_type",
        "architectures",
        "model_type",
        "draft_vocab_size",
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "eagle_aux_hidden_state_layer_ids",
    )
    lines = [f"{path}: model folder"]
    lines += [f"  config.{key}: {json.dumps(config[key])}" for key in keys if key in config]
    for sub in ("transformer_layer_config", "speculators_config"):
        if sub in config:
            lines.append(f"  config.{sub}: {json.dumps(config[sub])[:200]}")
    for weights in sorted(path.glob("*.safetensors")):
        lines += describe_safetensors(weights)
    return lines


def describe_file(path: Path) -> list[str]:
    import torch

    if path.suffix == ".safetensors":
        return describe_safetensors(path)
    if path.suffix in (".pt", ".pth", ".bin"):
        return describe_pt(path)
    if path.suffix == ".npy":
        import numpy as np

        array = np.load(path, allow_pickle=False)
        return [f"{path}: numpy {array.dtype} {list(array.shape)}  {_stats(torch.from_numpy(array))}"]
    return [f"{path}: {path.stat().st_size:,} bytes (not a tensor file)"]


def describe_folder(path: Path) -> list[str]:
    from eaglenest.artifacts.hidden_states.format import HIDDEN_KEY, shard_number
    from eaglenest.artifacts.hidden_states.online import MANIFEST_FILE

    files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    kinds = Counter(p.suffix for p in files)
    kinds_text = ", ".join(f"{count} {suffix or 'other'}" for suffix, count in kinds.items())
    lines = [f"{path}: folder, {len(files)} files ({kinds_text})"]
    if (path / MANIFEST_FILE).is_file():  # extract.store: online
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        lines.append(
            f"online extraction (nothing stored; the train stage computes them): {manifest.get('rows')} rows, "
            f"{manifest.get('tokens')} tokens, layers {manifest.get('layer_ids')}, rounded to "
            f"{manifest.get('dtype')}"
        )
    tensors = [p for p in files if p.suffix in (".safetensors", ".pt", ".pth", ".npy")]
    if not tensors:
        return lines
    lines += describe_file(tensors[0])
    safetensors = [p for p in tensors if p.suffix == ".safetensors"]
    if len(safetensors) > 1:  # headers only: cheap even for thousands of files
        shapes: Counter[str] = Counter()
        tokens = size = bad = 0
        for file in safetensors:
            try:
                header = read_header(file)
            except (OSError, ValueError):
                bad += 1
                continue
            bad += header.actual_size != header.expected_size
            size += header.actual_size
            if HIDDEN_KEY in header.tensors:
                dtype, shape = header.tensors[HIDDEN_KEY]
                shapes[f"{dtype} [seq, {', '.join(map(str, shape[1:]))}]"] += 1
                tokens += shape[0] if shape else 0
        shards = sum(1 for file in safetensors if shard_number(file) is not None)
        lines.append(
            f"summary of {len(safetensors)} safetensors files{f' ({shards} shards)' if shards else ''}: "
            f"{size:,} bytes, {tokens:,} tokens, {bad} unreadable or truncated"
        )
        lines += [f"  {HIDDEN_KEY} {shape}: {count} files" for shape, count in shapes.items()]
        if tokens:
            lines.append(f"  {size / tokens:.1f} bytes per token")
    return lines


def inspect_path(path: Path) -> list[str]:
    """Lines describing ``path``."""
    if not path.exists():
        raise InputFileError(f"{path}: no such file or folder")
    if path.is_file():
        return describe_file(path)
    if (path / "config.json").is_file():
        return describe_checkpoint(path)
    if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
        lines = describe_dataset(path)
        if (path / "hidden_states").is_dir():
            lines += describe_folder(path / "hidden_states")
        return lines
    return describe_folder(path)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", help="a .safetensors/.pt/.npy file, a checkpoint, dataset or folder")


def _run(args: argparse.Namespace) -> int:
    for path in args.paths:
        print("\n".join(inspect_path(Path(path))))
    return 0


COMMAND = Command(
    "inspect",
    help="show keys, shapes, dtypes, value ranges and token counts of dumps and checkpoints",
    add_arguments=_add_arguments,
    run=_run,
)
