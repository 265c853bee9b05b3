"""Chat helpers every stage that generates shares: which tokens end an assistant turn, and cutting there.

The prepare stage renders conversations and regenerates replies, the evaluate stage decodes them; all of
them must agree on where a reply ends, so the rule lives here, below every stage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def end_of_turn_ids(tokenizer: Any, model_dir: Path | None = None) -> set[int]:
    """Token ids that end an assistant turn: the tokenizer's EOS and generation_config's eos ids."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen_config = model_dir / "generation_config.json" if model_dir else None
    if gen_config is not None and gen_config.is_file():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


def cut_after_end_of_turn(tokens: list[int], eot_ids: set[int]) -> list[int]:
    """The tokens up to and including the first end-of-turn token (generation pads or runs on after it)."""
    for i, token in enumerate(tokens):
        if token in eot_ids:
            return tokens[: i + 1]
    return tokens


# Reasoning models (Qwen3, DeepSeek-R1, Kimi-K2 thinking) write their thinking inside <think>...</think> before
# the answer; their chat templates take it from an assistant message's ``reasoning_content`` or from the content
# itself, drop it from earlier turns, and switch it off with ``enable_thinking=False``.
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING_MARKERS = (THINK_OPEN, THINK_CLOSE, "reasoning_content", "enable_thinking")


def template_handles_reasoning(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template treats reasoning specially (mentions think blocks or switches)."""
    template = tokenizer.chat_template
    texts = template.values() if isinstance(template, dict) else [template or ""]
    return any(marker in text for text in texts for marker in REASONING_MARKERS)


def chat_template_kwargs(reasoning: str | None) -> dict[str, Any]:
    """What every rendering passes to the chat template for ``prepare.reasoning``: thinking on for ``keep``,
    off for ``strip`` (templates that do not know ``enable_thinking`` ignore it); nothing when unset."""
    return {} if reasoning is None else {"enable_thinking": reasoning == "keep"}


def strip_reasoning(text: str) -> str:
    """An assistant text without its thinking: what follows the last ``</think>``; a reply that opened a think
    block and never closed it (cut by a token limit) has no answer at all."""
    if THINK_CLOSE in text:
        return text.rsplit(THINK_CLOSE, 1)[1].lstrip("\n")
    if text.lstrip().startswith(THINK_OPEN):
        return ""
    return text


def without_reasoning(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The conversation with every assistant turn's thinking removed (``prepare.reasoning: strip``)."""
    stripped = []
    for message in messages:
        if message["role"] == "assistant":
            message = {"role": "assistant", "content": strip_reasoning(message["content"])}
        stripped.append(message)
    return stripped
