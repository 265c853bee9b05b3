"""Reading a safetensors file's header without its tensors: names, dtypes, shapes, metadata and the length the
header promises, so a truncated file is caught without reading it. Used by every reader of safetensors files
(hidden states, draft weights, the verifier's weight size).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class Header:
    """A parsed safetensors header: tensor name -> (dtype, shape), plus metadata and sizes."""

    tensors: dict[str, tuple[str, list[int]]]
    metadata: dict[str, str]
    expected_size: int
    actual_size: int


def tensor_extents(path: Path) -> tuple[int, dict[str, tuple[str, list[int], int, int]]]:
    """Where each tensor's bytes lie: (offset of the data section, ``{name: (dtype, shape, begin, end)}``), begin
    and end relative to the data section, as the header records them.

    Raises:
        ValueError: as :func:`read_header`.
    """
    read_header(path)  # the checks
    with open(path, "rb") as fh:
        (header_len,) = struct.unpack("<Q", fh.read(8))
        raw = json.loads(fh.read(header_len))
    raw.pop("__metadata__", None)
    return 8 + header_len, {
        name: (
            str(entry["dtype"]),
            [int(d) for d in entry["shape"]],
            int(entry["data_offsets"][0]),
            int(entry["data_offsets"][1]),
        )
        for name, entry in raw.items()
    }


def read_header(path: Path) -> Header:
    """Parses a safetensors header without reading the tensors.

    Raises:
        ValueError: the file is too short, or its header is not a safetensors header.
    """
    size = path.stat().st_size
    with open(path, "rb") as fh:
        prefix = fh.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{size} bytes, too short for a safetensors file")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"header length {header_len} does not fit in a {size}-byte file (truncated?)")
        try:
            raw = json.loads(fh.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"unreadable safetensors header ({err})") from None
    if not isinstance(raw, dict):
        raise ValueError("safetensors header is not an object")
    metadata = raw.pop("__metadata__", None) or {}
    tensors: dict[str, tuple[str, list[int]]] = {}
    data_end = 0
    for name, entry in raw.items():
        try:
            tensors[name] = (str(entry["dtype"]), [int(d) for d in entry["shape"]])
            data_end = max(data_end, int(entry["data_offsets"][1]))
        except (KeyError, TypeError, ValueError, IndexError):
            raise ValueError(f"malformed header entry for tensor {name!r}") from None
    return Header(tensors=tensors, metadata=metadata, expected_size=8 + header_len + data_end, actual_size=size)
