"""Text an evaluation set shares with training text: whole normalised prompts and 50-character stretches.

A draft evaluated on text it was trained on measures recall. ``evaluate`` refuses a prompt found whole in a
training row (:func:`eaglenest.artifacts.eval_sets.check_disjoint`); the sources that ship with the project
are held to this stricter rule, by their snapshot scripts and by tests/stages/prepare/test_disjoint_sources.py,
which import it from here (no stage runs it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from eaglenest.stages.prepare.self_instruct import normalised as prompt_key

STRETCH = 50


def normalised(text: str) -> str:
    """The prepare stage's prompt key (lower case, whitespace collapsed), with a run of one punctuation character
    (an underline, a table border) as one: formatting is not text, and documents on both sides have tables and
    headings."""
    return re.sub(r"([^\w\s])\1+", r"\1", prompt_key(text))


def stretches(text: str) -> set[str]:
    """Every STRETCH-character window of the normalised text (the whole text when it is shorter)."""
    text = normalised(text)
    if len(text) <= STRETCH:
        return {text} if text else set()
    return {text[i : i + STRETCH] for i in range(len(text) - STRETCH + 1)}


class StretchIndex:
    """The stretches of a set of protected texts (evaluation prompts), each with the name of its text."""

    def __init__(self, protected: Iterable[tuple[str, str]]):
        self.owner: dict[str, str] = {}
        for name, text in protected:
            for stretch in stretches(text):
                self.owner.setdefault(stretch, name)
        # whole texts shorter than a stretch are looked for anywhere in a candidate
        self.short = {s: name for s, name in self.owner.items() if len(s) < STRETCH}

    def shared(self, text: str) -> tuple[str, str] | None:
        """(protected text's name, the shared stretch) of the first overlap with ``text``, or None."""
        text = normalised(text)
        for i in range(max(1, len(text) - STRETCH + 1)):
            if text[i : i + STRETCH] in self.owner:
                return self.owner[text[i : i + STRETCH]], text[i : i + STRETCH]
        for stretch, name in self.short.items():
            if stretch in text:
                return name, stretch
        return None
