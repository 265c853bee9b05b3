"""The evaluation prompt sets: ``val`` (held-out conversations of the training mix) and ``general`` (prompts of
other kinds, disjoint from training), read from JSONL and rendered with the verifier's chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eaglenest.artifacts.prepared import VAL_PROMPTS_FILE, load_chat_kwargs, load_split
from eaglenest.core.errors import InputFileError
from eaglenest.core.params import EvaluateParams


def load_prompts(source: Path, num_prompts: int, tokenizer: Any, param: str = "evaluate.prompts",
                 chat_kwargs: dict[str, Any] | None = None
                 ) -> list[dict[str, Any]]:
    """The first ``num_prompts`` records of a prompts file, each ``{"messages", "token_ids"}``: the messages
    (a bare ``prompt`` becomes one user message) and their chat-template rendering with the generation prompt."""
    try:
        lines = source.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise InputFileError(f"{source}: prompts file not found ({param})") from None
    except UnicodeDecodeError as err:
        raise InputFileError(f"{source}: not UTF-8 text ({err.reason})") from None
    prompts: list[dict[str, Any]] = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputFileError(f"{source}: line {line_no}: not valid JSON: {err.msg}") from None
        if isinstance(record, dict) and isinstance(record.get("messages"), list) and record["messages"]:
            messages = record["messages"]
        elif isinstance(record, dict) and isinstance(record.get("prompt"), str) and record["prompt"].strip():
            messages = [{"role": "user", "content": record["prompt"]}]
        else:
            raise InputFileError(
                f"{source}: line {line_no}: expected {{'messages': [...]}} or {{'prompt': '...'}}"
            )
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             **(chat_kwargs or {}))
        prompts.append({"messages": messages, "token_ids": tokenizer(text, add_special_tokens=False)["input_ids"]})
        if len(prompts) == num_prompts:
            break
    if not prompts:
        raise InputFileError(f"{source}: no prompts ({param})")
    return prompts


def load_prompt_sets(params: EvaluateParams, prepared_dir: Path, tokenizer: Any) -> dict[str, list[list[int]]]:
    """Token ids of each evaluation set: ``val`` (held-out conversations, or evaluate.prompts) and, with
    evaluate.general_prompts, ``general``, which must share no prompt with the training rows."""
    val_source = Path(params.prompts) if params.prompts else prepared_dir / VAL_PROMPTS_FILE
    # Prompts are rendered as training rendered its conversations (prepare.reasoning's thinking switch).
    chat_kwargs = load_chat_kwargs(prepared_dir)
    sets = {"val": load_prompts(val_source, params.num_prompts, tokenizer, chat_kwargs=chat_kwargs)}
    if params.general_prompts:
        general = load_prompts(Path(params.general_prompts), params.num_prompts, tokenizer, "evaluate.general_prompts",
                               chat_kwargs)
        check_disjoint(general, prepared_dir, tokenizer, f"evaluate.general_prompts ({params.general_prompts})")
        sets["general"] = general
    return {name: [p["token_ids"] for p in prompts] for name, prompts in sets.items()}


def check_disjoint(prompts: list[dict[str, Any]], prepared_dir: Path, tokenizer: Any, what: str) -> None:
    """Refuses a set whose user messages appear in a training row: it would measure recall, not generalization.

    Raises:
        InputFileError: naming the set and the first prompt found in the training rows.
    """
    from datasets import load_from_disk

    train_rows = load_split(prepared_dir)["train_rows"]
    dataset = load_from_disk(str(prepared_dir)).with_format(None)
    texts = [tokenizer.decode(ids) for ids in dataset[:train_rows]["input_ids"]]
    for number, prompt in enumerate(prompts, start=1):
        for message in prompt["messages"]:
            content = message["content"].strip()
            if message["role"] == "user" and any(content in text for text in texts):
                raise InputFileError(
                    f"{what}: prompt {number} ({content[:60]!r}) is also in the training rows of {prepared_dir}: an "
                    "evaluation set must be disjoint from training; remove it from the set or from prepare.source"
                )
