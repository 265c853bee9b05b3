"""Loss masks token by token, and the prepared dataset in speculators' schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from datasets import load_from_disk

from eaglenest.artifacts.prepared import load_split
from eaglenest.core.chat import end_of_turn_ids
from eaglenest.core.errors import TemplateError
from eaglenest.stages.prepare import first_user_turn, prepare_dataset, render_rows
from eaglenest.stages.prepare.params import PrepareParams
from tests.fixtures.models import expected_from_pieces, write_jsonl

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "I am fine thanks"},
    {"role": "user", "content": "what is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital."},
]


def tiny_pieces(messages):
    # <|role|>\n{content}<|end|>\n per turn; the assistant's content and <|end|> are what it generates.
    pieces = []
    for j, m in enumerate(messages):
        generated = int(m["role"] == "assistant" and j > 0)
        pieces += [(f"<|{m['role']}|>", 0), ("\n", 0), (m["content"], generated), ("<|end|>", generated), ("\n", 0)]
    return pieces


def chatml_pieces(messages, default_system: str | None):
    pieces = []
    if default_system is not None:
        pieces += [("<|im_start|>", 0), ("system\n" + default_system, 0), ("<|im_end|>", 0), ("\n", 0)]
    for j, m in enumerate(messages):
        generated = int(m["role"] == "assistant" and j > 0)
        pieces += [
            ("<|im_start|>", 0),
            (m["role"] + "\n", 0),
            (m["content"], generated),
            ("<|im_end|>", generated),
            ("\n", 0),
        ]
    return pieces


def test_tiny_template_mask_token_by_token(tiny_tokenizer):
    (row,) = render_rows(tiny_tokenizer, CONVERSATION, 10_000, end_of_turn_ids(tiny_tokenizer))
    ids, mask = expected_from_pieces(tiny_tokenizer, tiny_pieces(CONVERSATION))
    assert row.input_ids == ids
    assert row.loss_mask == mask
    assert not row.truncated


def test_smollm2_mask_token_by_token(smollm2_tokenizer):
    messages = CONVERSATION[1:]  # no system turn: SmolLM2's template inserts its default one
    (row,) = render_rows(smollm2_tokenizer, messages, 10_000, end_of_turn_ids(smollm2_tokenizer))
    default_system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    ids, mask = expected_from_pieces(smollm2_tokenizer, chatml_pieces(messages, default_system))
    assert row.input_ids == ids
    assert row.loss_mask == mask
    masked_text = smollm2_tokenizer.decode([i for i, m in zip(row.input_ids, row.loss_mask, strict=True) if m])
    assert masked_text == "I am fine thanks<|im_end|>Paris is the capital.<|im_end|>"


def test_smollm2_mask_matches_generation_prompt(smollm2_tokenizer):
    """The first masked token is exactly where the verifier starts generating."""
    prompt = smollm2_tokenizer.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True, tokenize=False)
    prompt_ids = smollm2_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    (row,) = render_rows(smollm2_tokenizer, CONVERSATION[:3], 10_000, end_of_turn_ids(smollm2_tokenizer))
    assert row.input_ids[: len(prompt_ids)] == prompt_ids
    assert row.loss_mask.index(1) == len(prompt_ids)


def test_truncation(tiny_tokenizer):
    (row,) = render_rows(tiny_tokenizer, CONVERSATION, 12, end_of_turn_ids(tiny_tokenizer))
    assert len(row.input_ids) == 12 and len(row.loss_mask) == 12 and row.truncated


def test_history_rewriting_template_is_refused(tiny_tokenizer):
    rewriting = (
        "{% for m in messages %}{% if loop.last %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
        "{% else %}<|{{ m['role'] }}|>\n...<|end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    original = tiny_tokenizer.chat_template
    tiny_tokenizer.chat_template = rewriting
    try:
        with pytest.raises(TemplateError, match=r"chat template cannot be rendered per turn: messages\[:2\] .*fix: "):
            render_rows(tiny_tokenizer, CONVERSATION, 10_000, end_of_turn_ids(tiny_tokenizer))
    finally:
        tiny_tokenizer.chat_template = original


def test_first_user_turn():
    assert first_user_turn(CONVERSATION) == CONVERSATION[:2]


def test_prepare_dataset_counts_splits_and_speculators_opens_it(tmp_path: Path, tiny_tokenizer):
    records = [{"messages": CONVERSATION}] * 18
    records.append({"messages": [{"role": "user", "content": "hello there"}]})  # no assistant turn
    # An assistant turn that starts after max_len tokens: nothing left to learn once truncated.
    records.append({"messages": [{"role": "user", "content": "hello there " * 40}, CONVERSATION[2]]})
    source = write_jsonl(tmp_path / "convs.jsonl", records)
    params = PrepareParams(source=[str(source)], max_conversations=None, max_len=64, val_fraction=0.2, seed=1)
    out, metrics_path = tmp_path / "prepared", tmp_path / "metrics" / "prepare.json"

    metrics = prepare_dataset(params, tiny_tokenizer, out, metrics_path, end_of_turn_ids(tiny_tokenizer))

    assert json.loads(metrics_path.read_text()) == metrics
    assert metrics["records_read"] == 20
    assert metrics["kept"] == 18
    assert metrics["dropped"] == {"no_assistant_turn": 1, "no_assistant_tokens_after_truncation": 1}
    assert (metrics["train_rows"], metrics["val_rows"]) == (14, 4)
    dataset = load_from_disk(str(out))
    assert dataset.column_names == ["input_ids", "loss_mask", "seq_len"]
    assert metrics["tokens"] == sum(int(n) for n in dataset["seq_len"])
    assert metrics["loss_tokens"] == sum(int(m.sum()) for m in dataset["loss_mask"])
    assert dataset[0]["input_ids"].dtype == torch.int64 and dataset[0]["loss_mask"].dtype == torch.int64
    split = load_split(out)
    assert split["train_rows"] == 14
    prompts = [json.loads(line) for line in (out / "val_prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == 4 and prompts[0]["messages"] == CONVERSATION[:2]

    from speculators.train.data import ArrowDataset

    train = ArrowDataset(max_len=64, datapath=out, train_ratio=split["train_ratio"], split="train", on_missing="skip")
    val = ArrowDataset(max_len=64, datapath=out, train_ratio=split["train_ratio"], split="val", on_missing="skip")
    assert (len(train), len(val)) == (14, 4)
    assert val.start_file_idx == 14


def test_prepare_is_deterministic_and_seeded(tmp_path: Path, tiny_tokenizer):
    records = [{"messages": [CONVERSATION[1], {"role": "assistant", "content": f"fine {i}"}]} for i in range(10)]
    source = write_jsonl(tmp_path / "c.jsonl", records)

    def run(seed: int, name: str) -> list[list[int]]:
        params = PrepareParams(source=[str(source)], max_conversations=6, seed=seed)
        eot = end_of_turn_ids(tiny_tokenizer)
        prepare_dataset(params, tiny_tokenizer, tmp_path / name, tmp_path / f"{name}.json", eot)
        return [r.tolist() for r in load_from_disk(str(tmp_path / name))["input_ids"]]

    assert run(0, "a") == run(0, "b")
    assert run(0, "a") != run(1, "c")
    assert len(run(0, "a")) == 6
