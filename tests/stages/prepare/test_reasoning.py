"""Reasoning chat templates: each reply rendered against the context its model saw, thinking kept or stripped.

The two templates below are written for the tiny tokenizer to behave as Qwen3's and Kimi-K2's templates are
documented to: thinking of earlier turns is dropped (Qwen3: the reply alone; Kimi-K2: an empty think block),
the reply after the last user message keeps ``<think>`` (Qwen3 reads it from ``reasoning_content`` or from the
content; Kimi-K2 from ``reasoning_content``), and ``enable_thinking=False`` puts an empty think block into the
generation prompt. Expected rows are written out by hand, piece by piece, independently of the templates.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from datasets import load_from_disk

from eaglenest.artifacts.prepared import CHAT_FILE, load_chat_kwargs, load_split
from eaglenest.core.chat import chat_template_kwargs, end_of_turn_ids, strip_reasoning, without_reasoning
from eaglenest.core.errors import ParamsError
from eaglenest.stages.prepare import prepare_dataset, render_rows
from eaglenest.stages.prepare.params import PrepareParams
from eaglenest.stages.prepare.regenerate import regenerate
from tests.fixtures.models import KIMI_K2_LIKE, QWEN3_LIKE, build_tiny_tokenizer, expected_from_pieces, write_jsonl

# Thinking inline in the content (as Qwen3 writes it), and in reasoning_content (as Kimi-K2's API returns it).
INLINE = [
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "<think>\nthe weather is nice\n</think>\n\nI am fine thanks"},
    {"role": "user", "content": "what is the capital of France?"},
    {"role": "assistant", "content": "<think>\nnumbers 0 1 2\n</think>\n\nParis is the capital."},
]
FIELD = [
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "I am fine thanks", "reasoning_content": "the weather is nice"},
    {"role": "user", "content": "what is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital.", "reasoning_content": "numbers 0 1 2"},
]


def user(text: str) -> list[tuple[str, int]]:
    return [("<|user|>", 0), ("\n", 0), (text, 0), ("<|end|>", 0), ("\n", 0)]


def reply(text: str, generated: int = 1) -> list[tuple[str, int]]:
    """The reply's text and its end-of-turn token (generated), then the template's newline (not)."""
    return [(text, generated), ("<|end|>", generated), ("\n", 0)]


def tokenizer_with(template: str):
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = template
    return tokenizer


def assert_rows(tokenizer, messages, reasoning: str, expected_pieces: list[list[tuple[str, int]]]) -> None:
    if reasoning == "strip":
        messages = without_reasoning(messages)
    rows = render_rows(tokenizer, messages, 10_000, end_of_turn_ids(tokenizer), chat_template_kwargs(reasoning))
    assert len(rows) == len(expected_pieces)
    for row, pieces in zip(rows, expected_pieces, strict=True):
        ids, mask = expected_from_pieces(tokenizer, pieces)
        assert row.input_ids == ids
        assert row.loss_mask == mask, [(tokenizer.decode([t]), m) for t, m in zip(ids, row.loss_mask, strict=True)]


def test_qwen3_like_keep_trains_each_reply_with_its_thinking_after_the_context_the_model_saw():
    tokenizer = tokenizer_with(QWEN3_LIKE)
    first = [
        *user("hello there"),
        ("<|assistant|>", 0),
        ("\n", 0),
        *reply("<think>\nthe weather is nice\n</think>\n\nI am fine thanks"),
    ]
    # The second reply's context holds the first reply without its thinking, as the template renders history.
    second = [
        *user("hello there"),
        ("<|assistant|>", 0),
        ("\n", 0),
        *reply("I am fine thanks", 0),
        *user("what is the capital of France?"),
        ("<|assistant|>", 0),
        ("\n", 0),
        *reply("<think>\nnumbers 0 1 2\n</think>\n\nParis is the capital."),
    ]
    assert_rows(tokenizer, INLINE, "keep", [first, second])
    assert_rows(tokenizer, FIELD, "keep", [first, second])  # reasoning_content renders the same


def test_qwen3_like_strip_trains_answers_after_an_empty_think_block_in_the_prompt():
    tokenizer = tokenizer_with(QWEN3_LIKE)
    empty_think = [("<|assistant|>", 0), ("\n", 0), ("<think>\n\n</think>\n\n", 0)]
    first = [*user("hello there"), *empty_think, *reply("I am fine thanks")]
    second = [
        *user("hello there"),
        ("<|assistant|>", 0),
        ("\n", 0),
        *reply("I am fine thanks", 0),
        *user("what is the capital of France?"),
        *empty_think,
        *reply("Paris is the capital."),
    ]
    assert_rows(tokenizer, INLINE, "strip", [first, second])


def test_kimi_k2_like_keep_and_strip():
    tokenizer = tokenizer_with(KIMI_K2_LIKE)
    head = [("<|assistant|>", 0), ("\n", 0)]
    first = [*user("hello there"), *head, *reply("<think>the weather is nice</think>I am fine thanks")]
    second = [
        *user("hello there"),
        *head,
        *reply("<think></think>I am fine thanks", 0),
        *user("what is the capital of France?"),
        *head,
        *reply("<think>numbers 0 1 2</think>Paris is the capital."),
    ]
    assert_rows(tokenizer, FIELD, "keep", [first, second])
    # strip: the empty think block is the generation prompt's, then the answer. Without thinking, history renders
    # as the last turn does, so the template is prefix-stable again: one row, both answers trained.
    both = [
        *user("hello there"),
        *head,
        ("<think></think>", 0),
        *reply("I am fine thanks"),
        *user("what is the capital of France?"),
        *head,
        ("<think></think>", 0),
        *reply("Paris is the capital."),
    ]
    assert_rows(tokenizer, FIELD, "strip", [both])


def test_strip_reasoning():
    assert strip_reasoning("<think>\nhmm\n</think>\n\nanswer") == "answer"
    assert strip_reasoning("answer only") == "answer only"
    assert strip_reasoning("<think>cut off by the token limit") == ""
    assert without_reasoning(FIELD)[1] == {"role": "assistant", "content": "I am fine thanks"}


def test_a_reasoning_template_needs_prepare_reasoning(tmp_path: Path):
    tokenizer = tokenizer_with(QWEN3_LIKE)
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": INLINE}] * 4)
    params = PrepareParams(source=[str(source)], max_conversations=None, max_assistant_turns=None)
    with pytest.raises(
        ParamsError,
        match=r"prepare.reasoning is unset, but the chat template of .* handles reasoning "
        r"\(<think> blocks\); set prepare.reasoning: keep .* or strip",
    ):
        prepare_dataset(params, tokenizer, tmp_path / "prepared", tmp_path / "prepare.json", end_of_turn_ids(tokenizer))
    assert not (tmp_path / "prepared").exists()


def test_prepare_splits_by_conversation_and_records_the_template_switch(tmp_path: Path):
    """A conversation's rows (one per reply) stay on one side of the split; evaluate renders as prepare did."""
    tokenizer = tokenizer_with(QWEN3_LIKE)
    records = [
        {"messages": [{**m, "content": m["content"].replace("hello", f"hello {i}")} for m in INLINE]} for i in range(10)
    ]
    source = write_jsonl(tmp_path / "chats.jsonl", records)
    params = PrepareParams(
        source=[str(source)], max_conversations=None, max_assistant_turns=None, val_fraction=0.2, reasoning="strip"
    )
    metrics = prepare_dataset(
        params, tokenizer, tmp_path / "prepared", tmp_path / "prepare.json", end_of_turn_ids(tokenizer)
    )
    assert (metrics["kept"], metrics["rows"], metrics["train_rows"], metrics["val_rows"]) == (10, 20, 16, 4)
    assert load_split(tmp_path / "prepared")["train_rows"] == 16
    rows = load_from_disk(str(tmp_path / "prepared")).with_format(None)["input_ids"]
    conversation_of = [tokenizer.decode(ids).split("hello ")[1].split()[0] for ids in rows]
    assert not set(conversation_of[:16]) & set(conversation_of[16:])
    assert "<think>" not in "".join(tokenizer.decode(ids) for ids in rows).replace("<think>\n\n</think>", "")
    assert json.loads((tmp_path / "prepared" / CHAT_FILE).read_text()) == {"enable_thinking": False}
    assert load_chat_kwargs(tmp_path / "prepared") == {"enable_thinking": False}


@pytest.mark.parametrize("reasoning", ["keep", "strip"])
def test_regeneration_renders_with_the_switch_and_keeps_or_drops_thinking(tmp_path: Path, reasoning: str):
    tokenizer = tokenizer_with(QWEN3_LIKE)
    prompts_seen: list[str] = []

    def thinking_verifier(prompts: list[list[int]], seed: int, sampling=None) -> list[list[int]]:
        prompts_seen.extend(tokenizer.decode(p) for p in prompts)
        text = "<think>\nthe weather is nice\n</think>\n\nI am fine thanks<|end|>"
        return [tokenizer(text, add_special_tokens=False)["input_ids"] for _ in prompts]

    conversation = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": ""}]
    params = PrepareParams(regenerate_max_new_tokens=32, regenerate_batch_size=4, reasoning=reasoning)
    out, _ = regenerate(
        [conversation], thinking_verifier, tokenizer, params, fingerprint="f", cache_dir=tmp_path / "cache"
    )
    thinking_off = prompts_seen[0].endswith("<think>\n\n</think>\n\n")
    assert thinking_off == (reasoning == "strip")
    thought = "<think>\nthe weather is nice\n</think>\n\n"
    expected = "I am fine thanks" if reasoning == "strip" else thought + "I am fine thanks"
    assert out[0][1]["content"] == expected
    # keep, strip and no setting never share cached replies.
    keys = {p.name for p in (tmp_path / "cache").iterdir()}
    unset = params.model_copy(update={"reasoning": None})
    regenerate([conversation], thinking_verifier, tokenizer, unset, fingerprint="f", cache_dir=tmp_path / "cache")
    assert len({p.name for p in (tmp_path / "cache").iterdir()} - keys) == 1


def test_reasoning_content_is_read_from_conversation_files(tmp_path: Path):
    from eaglenest.stages.prepare.sources import read_source

    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": FIELD}])
    (conversation,) = read_source(str(source))
    assert conversation.messages == FIELD
