"""Writes data/conversations/package-docs.jsonl: documentation excerpts to summarize or answer from.

    .venv/bin/python scripts/snapshot_package_docs.py [--count 400] [--out FILE]

A draft trained on short chat prompts has rarely seen a prompt that carries a document, and a reply that
restates it: the traffic of summaries and questions about a text. Every installed package ships such text:
the long description of its metadata (its README). Each record is one excerpt of it, cut at paragraph breaks
to at most ``MAX_EXCERPT_CHARS`` (so request, excerpt and a 64-token reply fit a 512-token row), inside one
of three requests, in turn::

    {"prompt": "<request>\\n\\n<excerpt>", "kind": "summarize" | "explain" | "answer", "id": "<package>:<n>",
     "licence": "<the package's licence>"}

There is no reply: ``builtin:package-docs`` needs ``prepare.regenerate: true``, and the verifier writes it.
Only packages under a permissive licence (``PERMISSIVE``) are taken, and each record names it. Badges, images
and HTML lines are dropped; packages in ``EXCLUDED`` (this project's own README quotes its
evaluation sets) are skipped. Packages are taken in name order, at most ``MAX_EXCERPTS_PER_PACKAGE`` excerpts
each, until ``--count``. The file is a snapshot, committed and a dependency of prepare: upgraded packages change
the pipeline only when this script is run again and its output committed. An excerpt that shares a
50-character stretch with a prompt of the shipped evaluation sets is left out
(scripts/_overlap.py; tests/stages/prepare/test_disjoint_sources.py checks the file); the ``long``
evaluation set is Python's own documentation.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "data" / "conversations" / "package-docs.jsonl"
EXCLUDED = {"eaglenest"}
MIN_DESCRIPTION_CHARS = 3000  # a shorter description is a blurb, not documentation
MIN_EXCERPT_CHARS, MAX_EXCERPT_CHARS = 500, 1000  # about 150 to 450 SmolLM2 tokens (code is denser)
MAX_EXCERPTS_PER_PACKAGE = 3
# A line that is markup, not prose: images, badges, raw HTML, reST directives, substitutions and underlines.
MARKUP_LINE = re.compile(
    r"^\s*(!\[|\[!\[|<[a-zA-Z/!]|\.\. |\|[^|]+\| image::|:target:|:alt:|(\|[\w-]+\|\s*)+$"
    r"|([=\-~^*#+`_])\3{3,}\s*$)"
)
# Licences that let the excerpts be copied into this repository with attribution (the record names both).
PERMISSIVE = ("mit", "bsd", "apache", "isc", "psf", "python software foundation", "unlicense", "0bsd", "zlib")
REQUESTS = (
    ("summarize", "Here is part of a software project's README. Give a short summary of what it says.\n\n{excerpt}"),
    (
        "explain",
        "What does this documentation excerpt explain? Answer in plain words for someone new to the "
        "project.\n\n{excerpt}",
    ),
    ("answer", "{excerpt}\n\nUsing only the excerpt above, list the key points a new user should know."),
)


def paragraphs(description: str) -> list[str]:
    """The description's paragraphs, markup lines dropped, empty ones removed."""
    kept = []
    for block in re.split(r"\n\s*\n", description):
        lines = [line.rstrip() for line in block.splitlines() if not MARKUP_LINE.match(line)]
        text = "\n".join(lines).strip()
        if text:
            kept.append(text)
    return kept


def excerpts(
    description: str,
    shortest: int = MIN_EXCERPT_CHARS,
    longest: int = MAX_EXCERPT_CHARS,
    longest_paragraph: int = MAX_EXCERPT_CHARS,
) -> list[str]:
    """Consecutive paragraphs joined into excerpts of ``shortest`` to ``longest`` characters.

    A paragraph longer than ``longest_paragraph`` (a table, a long code listing) ends the excerpt being built
    and is not part of any.
    """
    found, current = [], ""
    for paragraph in paragraphs(description):
        if len(paragraph) > min(longest, longest_paragraph):
            current = ""
            continue
        joined = f"{current}\n\n{paragraph}" if current else paragraph
        if len(joined) > longest:
            if len(current) >= shortest:
                found.append(current)
            joined = paragraph
        current = joined
    if len(current) >= shortest:
        found.append(current)
    return found


def records(count: int) -> list[dict[str, str]]:
    """Up to ``count`` excerpts, packages in name order, each wrapped in the next request of ``REQUESTS``."""
    return package_records(count, excerpts, REQUESTS, MAX_EXCERPTS_PER_PACKAGE)


def package_records(
    count: int, cut: Callable[[str], list[str]], requests: tuple[tuple[str, str], ...], per_package: int
) -> list[dict[str, str]]:
    """Up to ``count`` excerpts (``cut`` of each README), packages in name order, ``per_package`` at most each.

    Each excerpt is wrapped in the next of ``requests`` (``(kind, template with {excerpt})``); an excerpt that
    shares a 50-character stretch with a shipped evaluation prompt is skipped.
    """
    described = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        description = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        licence = permissive_licence(dist.metadata)
        if name and name.lower() not in EXCLUDED and licence is not None and len(description) >= MIN_DESCRIPTION_CHARS:
            described.setdefault(name.lower(), (description, licence))
    from _overlap import StretchIndex  # scripts/, next to this file

    from eaglenest.artifacts.eval_prompts import shipped_evaluation_prompts

    evaluation = StretchIndex(shipped_evaluation_prompts())
    chosen: list[dict[str, str]] = []
    for name in sorted(described):
        description, licence = described[name]
        usable = [e for e in cut(description) if evaluation.shared(e) is None]  # never train on evaluation
        for number, excerpt in enumerate(usable[:per_package]):
            if len(chosen) == count:
                return chosen
            kind, template = requests[len(chosen) % len(requests)]
            chosen.append(
                {"prompt": template.format(excerpt=excerpt), "kind": kind, "id": f"{name}:{number}", "licence": licence}
            )
    return chosen


def permissive_licence(metadata: Any) -> str | None:
    """The package's licence when it is a permissive one (``PERMISSIVE``), else None (the package is skipped)."""
    declared = [metadata.get("License-Expression") or ""]
    declared += [c.split("::")[-1].strip() for c in metadata.get_all("Classifier") or [] if c.startswith("License")]
    declared.append((metadata.get("License") or "").splitlines()[0] if metadata.get("License") else "")
    for text in declared:
        lowered = text.lower()
        if (
            text
            and len(text) < 80
            and any(word in lowered for word in PERMISSIVE)
            and not any(copyleft in lowered for copyleft in ("gpl", "mpl", "epl"))
        ):
            return text
    return None


def summary(chosen: list[dict[str, str]]) -> str:
    """What a snapshot of package excerpts holds, for the script's last line."""
    return f"{len(chosen)} excerpts from {len({r['id'].rsplit(':', 1)[0] for r in chosen})} packages"


def main() -> int:
    from _snapshot import run  # scripts/, next to this file

    return run(__doc__, OUT, 400, records, summary)


if __name__ == "__main__":
    sys.exit(main())
