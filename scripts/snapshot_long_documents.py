"""Writes data/eval/long.jsonl: long documents to summarize or answer questions about (the ``long`` set).

    .venv/bin/python scripts/snapshot_long_documents.py [--count 24] [--out FILE]

Prompts that carry a long text (an article to summarize, a page to answer from) are traffic where vLLM's n-gram
drafting is strong: the reply copies stretches of the prompt. The interpreter ships such text with itself: the
topics of its documentation that ``help()`` shows (``pydoc_data.topics``, about 465k characters). Each record
is one topic, cut to at most ``MAX_DOCUMENT_CHARS`` at a paragraph break, inside one of three requests, in
turn::

    {"prompt": "<request>\\n\\n<document>", "kind": "summarize" | "explain" | "answer", "id": "pydoc:<topic>"}

Topics shorter than ``MIN_DOCUMENT_CHARS`` are left out (a short page is not a long-context prompt). The file is
a snapshot, committed and a dependency of evaluate: a new interpreter changes the set only when this script is
run again and its output committed. No training source may share text with it
(tests/stages/prepare/test_disjoint_sources.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "data" / "eval" / "long.jsonl"
MIN_DOCUMENT_CHARS, MAX_DOCUMENT_CHARS = 2500, 6000  # about 600 to 1,500 SmolLM2 tokens
REQUESTS = (
    ("summarize", "Summarize the following section of the Python documentation in a few sentences.\n\n{document}"),
    (
        "explain",
        "Read the documentation below, then explain to a beginner what it describes, with one short "
        "example.\n\n{document}",
    ),
    ("answer", "{document}\n\nBased only on the text above: what are the main rules it states?"),
)


def cut(text: str, limit: int) -> str:
    """The text up to the last paragraph break before ``limit`` characters (whole, when it is shorter)."""
    text = text.strip()
    if len(text) <= limit:
        return text
    head = text[:limit]
    return head[: head.rfind("\n\n")].rstrip() if "\n\n" in head else head


def records(count: int) -> list[dict[str, str]]:
    """``count`` topics in name order, each cut and wrapped in the next request of ``REQUESTS``."""
    from pydoc_data.topics import topics

    documents = [(name, cut(text, MAX_DOCUMENT_CHARS)) for name, text in sorted(topics.items())]
    documents = [(name, text) for name, text in documents if len(text) >= MIN_DOCUMENT_CHARS]
    if len(documents) < count:
        raise SystemExit(
            f"--count {count}: this interpreter's documentation has {len(documents)} topics of at "
            f"least {MIN_DOCUMENT_CHARS} characters"
        )
    chosen = []
    for number, (name, text) in enumerate(documents[:count]):
        kind, template = REQUESTS[number % len(REQUESTS)]
        chosen.append({"prompt": template.format(document=text), "kind": kind, "id": f"pydoc:{name}"})
    return chosen


def main() -> int:
    from _snapshot import run  # scripts/, next to this file

    return run(
        __doc__,
        OUT,
        24,
        records,
        lambda chosen: f"{len(chosen)} documents from Python {sys.version.split()[0]}'s pydoc_data.topics",
    )


if __name__ == "__main__":
    sys.exit(main())
