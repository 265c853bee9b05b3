"""prepare.source as a weighted mix, and builtin:self-instruct (prompts the verifier writes) with a scripted
generator: quotas, dedup, unfinished prompts, the cache, and the one-line errors for a mix that yields nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from datasets import load_from_disk

from eaglenest.commands.params_file import parse_params
from eaglenest.core.chat import end_of_turn_ids
from eaglenest.core.errors import EaglenestError, InputFileError, ParamsError
from eaglenest.stages.prepare import prepare_dataset, source_quotas
from eaglenest.stages.prepare.params import SELF_INSTRUCT_SOURCE, PrepareParams
from eaglenest.stages.prepare.regenerate import Sampling
from eaglenest.stages.prepare.self_instruct import user_prefix, write_prompts
from tests.fixtures.models import write_jsonl


def _entries(*pairs):
    return PrepareParams(source=[{"source": s, "weight": w} for s, w in pairs]).source


def test_quotas_split_max_conversations_by_weight_with_largest_remainder():
    assert source_quotas(_entries(("a.jsonl", 3), ("b.jsonl", 1)), 10) == {"a.jsonl": 8, "b.jsonl": 2}
    assert source_quotas(_entries(("a.jsonl", 1), ("b.jsonl", 1), ("c.jsonl", 1)), 10) == {
        "a.jsonl": 4,
        "b.jsonl": 3,
        "c.jsonl": 3,
    }
    assert source_quotas(_entries(("a.jsonl", 1), ("b.jsonl", 0)), 7) == {"a.jsonl": 7}  # weight 0: left out
    assert source_quotas(_entries(("a.jsonl", 1), ("b.jsonl", 2)), None) == {"a.jsonl": None, "b.jsonl": None}


def test_a_source_whose_weight_buys_no_conversation_is_refused():
    with pytest.raises(ParamsError, match=r"max_conversations = 3 gives b.jsonl no conversation"):
        source_quotas(_entries(("a.jsonl", 100), ("b.jsonl", 1)), 3)


@pytest.mark.parametrize(
    ("prepare", "message"),
    [
        ({"source": []}, "prepare.source"),
        ({"source": [{"source": "a.jsonl", "weight": 0}]}, "every weight is 0"),
        ({"source": [{"source": "a.jsonl", "weight": -1}]}, "greater than or equal to 0"),
        ({"source": [SELF_INSTRUCT_SOURCE], "regenerate": False}, "set prepare.regenerate: true"),
        ({"source": [SELF_INSTRUCT_SOURCE], "max_conversations": None}, "set prepare.max_conversations"),
        ({"source": ["a.jsonl", {"source": "a.jsonl", "weight": 2}]}, "lists a.jsonl more than once"),
        ({"source": [{"source": "a.jsonl", "share": 2}]}, "unknown key"),
    ],
)
def test_bad_mixes_are_one_line_naming_the_param(prepare, message):
    with pytest.raises(ParamsError) as err:
        parse_params({"prepare": prepare})
    problems = str(err.value).splitlines()[1:]
    assert len(problems) == 1, problems
    assert problems[0].lstrip(" -").startswith(("prepare.source", "prepare.max_conversations"))
    assert message in problems[0]


def test_string_entries_have_weight_one():
    params = parse_params({"prepare": {"source": ["a.jsonl", {"source": "b.jsonl", "weight": 2}]}}).prepare
    assert [(e.source, e.weight) for e in params.source] == [("a.jsonl", 1.0), ("b.jsonl", 2.0)]


def _chats(tmp_path: Path, name: str, count: int, tag: str) -> Path:
    return write_jsonl(
        tmp_path / name,
        [
            {
                "messages": [
                    {"role": "user", "content": f"{tag} question {i}"},
                    {"role": "assistant", "content": f"{tag} answer {i}"},
                ]
            }
            for i in range(count)
        ],
    )


def test_the_mix_takes_each_source_s_quota_and_spreads_them_over_the_split(tmp_path, tiny_tokenizer):
    a, b = _chats(tmp_path, "a.jsonl", 30, "apple"), _chats(tmp_path, "b.jsonl", 30, "pear")
    params = PrepareParams(
        source=[{"source": str(a), "weight": 3}, {"source": str(b), "weight": 1}],
        max_conversations=20,
        val_fraction=0.25,
        regenerate=False,
    )
    metrics = prepare_dataset(
        params, tiny_tokenizer, tmp_path / "out", tmp_path / "m.json", end_of_turn_ids(tiny_tokenizer)
    )
    assert metrics["picked_per_source"] == {str(a): 15, str(b): 5} and metrics["kept"] == 20
    texts = [tiny_tokenizer.decode(ids) for ids in load_from_disk(str(tmp_path / "out")).with_format(None)["input_ids"]]
    assert sum("apple" in t for t in texts) == 15 and sum("pear" in t for t in texts) == 5
    val = [json.loads(line) for line in (tmp_path / "out" / "val_prompts.jsonl").read_text().splitlines()]
    assert len(val) == 5 and all(p["origin"].startswith((str(a), str(b))) for p in val)


def test_a_source_that_yields_no_conversation_stops_prepare(tmp_path, tiny_tokenizer):
    lonely = write_jsonl(tmp_path / "lonely.jsonl", [{"messages": [{"role": "user", "content": "hello there"}]}])
    good = _chats(tmp_path, "good.jsonl", 10, "apple")
    params = PrepareParams(source=[str(good), str(lonely)], max_conversations=10, regenerate=False)
    with pytest.raises(InputFileError, match=r"prepare.source: .*lonely.jsonl yielded no conversation"):
        prepare_dataset(params, tiny_tokenizer, tmp_path / "out", tmp_path / "m.json", end_of_turn_ids(tiny_tokenizer))
    assert not (tmp_path / "out").exists()


class ScriptedVerifier:
    """A ReplyGenerator that 'writes' prompts from a script: each call takes the next completions."""

    def __init__(self, tokenizer, script: list[str | None]):
        self.tokenizer, self.script, self.calls = tokenizer, list(script), []
        self.eot = tokenizer.convert_tokens_to_ids("<|end|>")

    def __call__(self, prompts, seed, sampling=None):
        self.calls.append((len(prompts), seed, sampling))
        out = []
        for _ in prompts:
            text = self.script.pop(0) if self.script else None
            # None: a prompt still unfinished at max_new_tokens (no end-of-turn token)
            ids = (
                self.tokenizer("hello there how are you", add_special_tokens=False)["input_ids"]
                if text is None
                else self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eot]
            )
            out.append(ids)
        return out


def _write(tokenizer, verifier, count, cache_dir, **overrides):
    kwargs = {
        "fingerprint": "f",
        "generator": "scripted",
        "sampling": Sampling(1.0, 16),
        "hints": ["", "The user asks for help with code."],
        "seed": 0,
        "batch_size": 4,
        "cache_dir": cache_dir,
    }
    return write_prompts(count, verifier, tokenizer, {verifier.eot}, **{**kwargs, **overrides})


def test_self_instruct_keeps_finished_distinct_prompts_and_caches_every_batch(tmp_path, tiny_tokenizer):
    script = [
        "what is the weather",
        None,
        "What  is the WEATHER",
        "let us go for a walk",
        "",
        "numbers 1 2 3",
        None,
        "how are you today",
    ]
    verifier = ScriptedVerifier(tiny_tokenizer, script)
    prompts, stats = _write(tiny_tokenizer, verifier, 4, tmp_path / "cache")
    assert prompts == ["what is the weather", "let us go for a walk", "numbers 1 2 3", "how are you today"]
    assert (stats.tried, stats.unfinished, stats.duplicates) == (8, 2, 2)  # a repeat (case, spaces) and an empty one
    # one seed per batch, from prepare.seed and the batch's first prompt
    assert [(n, seed) for n, seed, _ in verifier.calls] == [(4, 0), (4, 4)]
    assert all(s == Sampling(1.0, 16) for *_, s in verifier.calls)

    again, stats = _write(tiny_tokenizer, ScriptedVerifier(tiny_tokenizer, []), 4, tmp_path / "cache")
    assert again == prompts and stats.cache_hits == 8  # nothing generated twice
    assert stats.tokens == 0  # nor counted as generated: prompt_tokens_per_s is then null, not a huge rate
    fresh = ScriptedVerifier(tiny_tokenizer, ["a new one"] * 8)
    _write(tiny_tokenizer, fresh, 4, tmp_path / "cache", sampling=Sampling(0.7, 16))
    assert fresh.calls, "another temperature is another cache entry"


def test_self_instruct_asks_for_no_more_than_the_yield_so_far_needs(tmp_path, tiny_tokenizer):
    script = [f"question number {i}" if i % 2 else None for i in range(40)]  # half of them unfinished
    verifier = ScriptedVerifier(tiny_tokenizer, script)
    prompts, stats = _write(tiny_tokenizer, verifier, 6, tmp_path / "cache", batch_size=8)
    # 4 of the first 8 kept, 2 still needed at that yield: 1.25 x 2 x 8 / 4 = 5 asked for, not 8
    assert [n for n, *_ in verifier.calls] == [8, 5]
    assert [seed for _, seed, _ in verifier.calls] == [0, 8]  # the next batch's seed counts on from the first
    assert len(prompts) == 6 and stats.tried == 12


def test_self_instruct_that_writes_nothing_usable_names_the_param(tmp_path, tiny_tokenizer):
    verifier = ScriptedVerifier(tiny_tokenizer, [None] * 100)
    with pytest.raises(
        EaglenestError,
        match=r"prepare.source builtin:self-instruct: the verifier wrote no usable "
        r"prompt in 16 tries \(16 ran past prepare.prompt_max_new_tokens = 16",
    ):
        _write(tiny_tokenizer, verifier, 4, tmp_path / "cache")


def test_user_prefix_is_the_template_up_to_the_user_message(tiny_tokenizer):
    plain = tiny_tokenizer.decode(user_prefix(tiny_tokenizer, ""))
    hinted = tiny_tokenizer.decode(user_prefix(tiny_tokenizer, "The user asks for help with code."))
    assert plain == "<|user|>\n"
    assert hinted == "<|system|>\nThe user asks for help with code.<|end|>\n<|user|>\n"


def test_self_instruct_conversations_are_regenerated_and_masked(tmp_path, tiny_tokenizer):
    """The prompts become user turns whose (empty) replies regeneration writes; the mask covers the replies."""
    chats = _chats(tmp_path, "chats.jsonl", 10, "apple")
    written = ["what is the weather", "let us go for a walk", "numbers 1 2 3", "how are you today"]

    def prompt_writer(count):
        return written[:count], None

    def regenerator(conversations):
        out = [[*m[:-1], {"role": "assistant", "content": "I am fine thanks"}] for m in conversations]
        return out, None

    params = PrepareParams(
        source=[{"source": SELF_INSTRUCT_SOURCE, "weight": 1}, {"source": str(chats), "weight": 1}],
        max_conversations=8,
        val_fraction=0.25,
    )
    metrics = prepare_dataset(
        params,
        tiny_tokenizer,
        tmp_path / "out",
        tmp_path / "m.json",
        end_of_turn_ids(tiny_tokenizer),
        regenerator,
        prompt_writer,
    )
    assert metrics["picked_per_source"] == {SELF_INSTRUCT_SOURCE: 4, str(chats): 4}
    dataset = load_from_disk(str(tmp_path / "out"))
    for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"], strict=True):
        masked = tiny_tokenizer.decode([t for t, m in zip(ids.tolist(), mask.tolist(), strict=True) if m])
        assert masked == "I am fine thanks<|end|>"


def test_package_docs_are_prompts_whose_replies_the_verifier_writes(tmp_path, tiny_tokenizer):
    """builtin:package-docs: documentation excerpts as user turns with empty replies; without regeneration there
    is nothing to train on, so that mix is refused before any work."""
    from eaglenest.stages.prepare.sources import PACKAGE_DOCS_FILE, read_source

    docs = read_source("builtin:package-docs")
    assert len(docs) == len(PACKAGE_DOCS_FILE.read_text(encoding="utf-8").splitlines()) >= 300
    assert all(
        [m["role"] for m in c.messages] == ["user", "assistant"]
        and c.messages[1]["content"] == ""
        and len(c.messages[0]["content"]) >= 500
        for c in docs
    )

    def regenerator(conversations):
        return [[*m[:-1], {"role": "assistant", "content": "It explains the package"}] for m in conversations], None

    params = PrepareParams(
        source=[{"source": "builtin:package-docs", "weight": 1}], max_conversations=6, max_len=4096, val_fraction=0.25
    )
    metrics = prepare_dataset(
        params,
        tiny_tokenizer,
        tmp_path / "out",
        tmp_path / "m.json",
        end_of_turn_ids(tiny_tokenizer),
        regenerator,
        lambda count: ([], None),
    )
    assert metrics["picked_per_source"] == {"builtin:package-docs": 6} and metrics["kept"] == 6
    with pytest.raises(ParamsError, match=r"builtin:package-docs has prompts only.*prepare.regenerate: true"):
        prepare_dataset(
            params.model_copy(update={"regenerate": False}),
            tiny_tokenizer,
            tmp_path / "out2",
            tmp_path / "m2.json",
            end_of_turn_ids(tiny_tokenizer),
        )
    assert not (tmp_path / "out2").exists()


def test_long_readmes_need_rows_long_enough_to_hold_them(tmp_path, tiny_tokenizer):
    """builtin:long-readmes: excerpts of 2,500 characters and more, prompts only; a prepare.max_len that would
    drop every one of them is refused in one line, before any work."""
    from eaglenest.stages.prepare.sources import LONG_READMES_FILE, read_source

    docs = read_source("builtin:long-readmes")
    assert len(docs) == len(LONG_READMES_FILE.read_text(encoding="utf-8").splitlines()) >= 150
    assert all(c.messages[1]["content"] == "" and len(c.messages[0]["content"]) >= 2500 for c in docs)

    def regenerator(conversations):
        return [[*m[:-1], {"role": "assistant", "content": "It says three things"}] for m in conversations], None

    params = PrepareParams(
        source=[{"source": "builtin:long-readmes", "weight": 1}], max_conversations=4, max_len=20_000, val_fraction=0.25
    )  # the tiny tokenizer spends a token per few bytes
    metrics = prepare_dataset(
        params,
        tiny_tokenizer,
        tmp_path / "out",
        tmp_path / "m.json",
        end_of_turn_ids(tiny_tokenizer),
        regenerator,
        lambda count: ([], None),
    )
    assert metrics["kept"] == 4
    with pytest.raises(ParamsError, match=r"builtin:long-readmes .* prepare.max_len >= 2048 \(now 512\)"):
        prepare_dataset(
            params.model_copy(update={"max_len": 512}),
            tiny_tokenizer,
            tmp_path / "out2",
            tmp_path / "m2.json",
            end_of_turn_ids(tiny_tokenizer),
            regenerator,
        )
    assert not (tmp_path / "out2").exists()


def test_math_problems_are_seeded_prompts_of_every_template():
    """builtin:math-problems: the same problems on every call (numbers from Random(i)), all different, every
    template used, each a question with numbers in it and an empty reply for the verifier to write."""
    from eaglenest.stages.prepare.math_problems import COUNT, TEMPLATES
    from eaglenest.stages.prepare.sources import read_source

    problems = read_source("builtin:math-problems")
    assert [c.messages for c in problems] == [c.messages for c in read_source("builtin:math-problems")]
    prompts = [c.messages[0]["content"] for c in problems]
    assert len(prompts) == COUNT and len(set(prompts)) == COUNT
    assert all(c.messages[1] == {"role": "assistant", "content": ""} for c in problems)
    assert all("?" in p and any(ch.isdigit() for ch in p) for p in prompts)
    assert len({p.split(" ", 2)[1] for p in prompts[: len(TEMPLATES)]}) > 1  # not one template over and over
