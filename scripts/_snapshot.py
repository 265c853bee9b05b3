"""The command line every snapshot script shares: ``--count`` and ``--out``, written atomically as JSONL."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path


def run(
    doc: str,
    out: Path,
    default_count: int,
    records: Callable[[int], list[dict[str, str]]],
    summary: Callable[[list[dict[str, str]]], str],
) -> int:
    """Parses the arguments, writes ``records(count)`` to ``--out`` (temp file, then rename), prints the summary."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--count", type=int, default=default_count, help=f"records (default: {default_count})")
    parser.add_argument("--out", type=Path, default=out, help=f"where to write (default: {out})")
    args = parser.parse_args()
    chosen = records(args.count)
    temporary = args.out.with_suffix(".tmp")
    temporary.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in chosen), encoding="utf-8")
    temporary.replace(args.out)
    print(f"{args.out}: {summary(chosen)}")
    return 0
