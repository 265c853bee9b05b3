"""Self-distillation: regenerated replies are the verifier's own greedy continuations, masked exactly."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eaglenest.params import PrepareParams
from eaglenest.prepare import end_of_turn_ids, prepare_dataset
from eaglenest.regenerate import hf_reply_generator, regenerate

from .conftest import write_jsonl

CONVERSATIONS = [
    [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "I am fine"}],
    [{"role": "user", "content": "what is the capital of France?"}, {"role": "assistant", "content": "Paris"},
     {"role": "user", "content": "and the weather?"}, {"role": "assistant", "content": "nice"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "numbers 0 1 2"},
     {"role": "assistant", "content": "3 4 5"}],
]


def greedy_reply(model, tokenizer, history, eos, max_new_tokens) -> str:
    """The verifier's own greedy continuation of one conversation prefix, unbatched."""
    text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=sorted(eos), pad_token_id=sorted(eos)[0])
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def test_regenerated_turns_are_the_verifiers_greedy_replies(tiny_verifier_dir: Path, tmp_path: Path):
    model = AutoModelForCausalLM.from_pretrained(tiny_verifier_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_verifier_dir)
    eos = end_of_turn_ids(tokenizer, tiny_verifier_dir)
    replies = hf_reply_generator(model, tokenizer, 0.0, 12, eos)
    out, stats = regenerate(CONVERSATIONS, replies, tokenizer, fingerprint="f", temperature=0.0, max_new_tokens=12,
                            max_len=512, batch_size=2, seed=0, cache_dir=tmp_path / "cache")
    assert stats.turns == 4 and stats.cache_hits == 0 and stats.tokens > 0
    for original, regenerated in zip(CONVERSATIONS, out, strict=True):
        assert [m["role"] for m in regenerated] == [m["role"] for m in original]
        for j, message in enumerate(regenerated):
            if message["role"] == "assistant":
                # conditioned on the regenerated history, exactly as the verifier would have continued
                assert message["content"] == greedy_reply(model, tokenizer, regenerated[:j], eos, 12)
            else:
                assert message == original[j]
    again, stats = regenerate(CONVERSATIONS, None, tokenizer, fingerprint="f", temperature=0.0, max_new_tokens=12,
                              max_len=512, batch_size=2, seed=0, cache_dir=tmp_path / "cache")
    assert again == out and stats.cache_hits == 3 and stats.turns == 0  # nothing regenerated twice


def test_prepare_with_regeneration_masks_exactly_the_new_replies(tiny_verifier_dir: Path, tmp_path: Path):
    from datasets import load_from_disk

    model = AutoModelForCausalLM.from_pretrained(tiny_verifier_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_verifier_dir)
    eos = end_of_turn_ids(tokenizer, tiny_verifier_dir)
    source = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS] * 2)
    seen: list[list[dict[str, str]]] = []

    def regenerator(conversations):
        result, stats = regenerate(conversations, hf_reply_generator(model, tokenizer, 0.0, 8, eos), tokenizer,
                                   fingerprint="f", temperature=0.0, max_new_tokens=8, max_len=512, batch_size=4,
                                   seed=0, cache_dir=tmp_path / "cache")
        seen.extend(result)
        return result, stats

    params = PrepareParams(source=[str(source)], max_conversations=None, val_fraction=0.2, regenerate=True)
    metrics = prepare_dataset(params, tokenizer, tmp_path / "prepared", tmp_path / "m.json", eos, regenerator)
    assert metrics["kept"] == 6 and metrics["regenerated_turns"] > 0
    rows = load_from_disk(str(tmp_path / "prepared")).with_format(None)
    replies = sorted(m["content"] for c in seen for m in c if m["role"] == "assistant")
    masked = []
    for row in rows:
        ids = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
        # each masked run is one reply followed by its end-of-turn token
        text = tokenizer.decode(ids)
        masked += [part.strip() for part in text.split("<|end|>") if part.strip()]
    assert sorted(masked) == sorted(r for r in replies if r)


def test_trim_keeps_the_first_n_replies():
    from eaglenest.prepare import trim_conversation

    two = CONVERSATIONS[1] + [{"role": "user", "content": "bye"}]
    assert trim_conversation(two, None) == CONVERSATIONS[1]  # trailing user turn dropped
    assert trim_conversation(two, 1) == CONVERSATIONS[1][:2]
    assert trim_conversation([{"role": "assistant", "content": "hi"}], 1) == [{"role": "assistant", "content": "hi"}]


class _FakeCompletion:
    def __init__(self, token_ids):
        self.token_ids = token_ids


class _FakeRequestOutput:
    def __init__(self, token_ids):
        self.outputs = [_FakeCompletion(token_ids)]


def test_vllm_regeneration_arguments(tiny_verifier_dir: Path, tmp_path: Path):
    from eaglenest.regenerate_vllm import build_regenerate_llm_kwargs, build_sampling_kwargs

    info, model_dir = load_verifier_info_for(tiny_verifier_dir, tmp_path)
    params = PrepareParams(regenerate=True, regenerate_backend="vllm", max_len=256, regenerate_max_new_tokens=64,
                           regenerate_temperature=0.7, regenerate_gpu_memory_utilization=0.5)
    llm = build_regenerate_llm_kwargs(params, info, model_dir)
    assert llm["model"] == str(model_dir) and llm["gpu_memory_utilization"] == 0.5
    assert llm["max_model_len"] == min(256 + 64, info.max_position_embeddings or 10**9)
    assert llm["trust_remote_code"] is False
    sampling = build_sampling_kwargs(params, {7, 3}, seed=11)
    assert sampling == {"temperature": 0.7, "max_tokens": 64, "stop_token_ids": [3, 7], "seed": 11}


def load_verifier_info_for(tiny_verifier_dir: Path, tmp_path: Path):
    """verifier.json for the tiny model, as the verifier stage writes it."""
    from eaglenest.params import VerifierParams
    from eaglenest.verifier import build_verifier, load_verifier_info

    out = tmp_path / "verifier"
    build_verifier(VerifierParams(model=str(tiny_verifier_dir)), out)
    return load_verifier_info(out)


def test_vllm_replies_are_cut_after_the_end_of_turn_token():
    from eaglenest.regenerate_vllm import replies_from_outputs

    outputs = [_FakeRequestOutput((5, 6, 2, 9)), _FakeRequestOutput([5, 6]), _FakeRequestOutput([])]
    assert replies_from_outputs(outputs, {2}) == [[5, 6, 2], [5, 6], []]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_regeneration_without_vllm_says_how_to_install(tiny_verifier_dir: Path, tmp_path: Path):
    from eaglenest.errors import EaglenestError
    from eaglenest.regenerate_vllm import vllm_reply_generator

    info, model_dir = load_verifier_info_for(tiny_verifier_dir, tmp_path)
    with pytest.raises(EaglenestError, match=r"prepare.regenerate_backend: vllm needs vLLM on a GPU machine"):
        vllm_reply_generator(PrepareParams(regenerate_backend="vllm"), info, model_dir, {2})
