"""Writes data/conversations/long-readmes.jsonl: long documentation excerpts to summarize or answer from.

    .venv/bin/python scripts/snapshot_long_readmes.py [--count 200] [--out FILE]

``builtin:package-docs`` cuts README excerpts to fit a 512-token row. Served traffic carries longer texts: an
article to summarize, a page to answer from, 600 to 1,500 tokens and more. A draft trained only on rows of
512 tokens has never attended to a position past 512, so this snapshot cuts the same READMEs (installed
packages' metadata descriptions, permissive licences only) into excerpts of ``MIN_EXCERPT_CHARS`` to
``MAX_EXCERPT_CHARS`` characters, about 600 to 1,900 SmolLM2 tokens, inside one of four requests, in turn::

    {"prompt": "<request>\\n\\n<excerpt>", "kind": "summarize" | "explain" | "answer" | "rewrite",
     "id": "<package>:<n>", "licence": "<the package's licence>"}

The rows they make need ``prepare.max_len`` and ``train.total_seq_len`` of at least 2048 (a shorter
``max_len`` truncates them). There is no reply: ``builtin:long-readmes`` needs ``prepare.regenerate: true``,
and the verifier writes it. Selection, licences and the evaluation-overlap rule are those of
``scripts/snapshot_package_docs.py``; the ``long`` evaluation set is Python's own documentation, another
family of text. The file is a committed snapshot and a dependency of prepare.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

from snapshot_package_docs import excerpts, package_records, summary  # scripts/, next to this file

OUT = Path(__file__).resolve().parents[1] / "data" / "conversations" / "long-readmes.jsonl"
MIN_EXCERPT_CHARS, MAX_EXCERPT_CHARS = 2500, 4500
MAX_PARAGRAPH_CHARS = 2000  # a longer block (a big table or listing) is left out
MAX_EXCERPTS_PER_PACKAGE = 2
REQUESTS = (
    ("summarize", "Summarize this document in one paragraph.\n\n{excerpt}"),
    ("explain", "{excerpt}\n\nExplain what the text above is about and how someone would use it."),
    (
        "answer",
        "Read the text below and answer: what problem does it address, and what are the main steps or "
        "options it describes?\n\n{excerpt}",
    ),
    ("rewrite", "Rewrite the main points of the following text as a short bulleted list.\n\n{excerpt}"),
)


def records(count: int) -> list[dict[str, str]]:
    """Up to ``count`` long excerpts, packages in name order, each in the next request of ``REQUESTS``."""
    cut = partial(
        excerpts, shortest=MIN_EXCERPT_CHARS, longest=MAX_EXCERPT_CHARS, longest_paragraph=MAX_PARAGRAPH_CHARS
    )
    return package_records(count, cut, REQUESTS, MAX_EXCERPTS_PER_PACKAGE)


def main() -> int:
    from _snapshot import run

    return run(__doc__, OUT, 200, records, summary)


if __name__ == "__main__":
    sys.exit(main())
