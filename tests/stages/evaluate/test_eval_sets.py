"""The evaluation sets: their formats (messages, prompt, FastChat/EAGLE question.jsonl with later turns asked
after the verifier's own answers, HumanEval from its package), their checks, and the figures written from their
records: intervals over prompts and the few headline numbers `dvc metrics diff` shows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from eaglenest.artifacts.eval_params import EvalSetParams, EvaluateParams
from eaglenest.artifacts.eval_sets import GENERAL_SET_FILE, LONG_SET_FILE, load_eval_set
from eaglenest.artifacts.evaluation import draft_vs_free, headline, summarize, tau_interval, verdict
from eaglenest.artifacts.prepared import write_prepared
from eaglenest.commands.params_file import parse_params
from eaglenest.core.bootstrap import bootstrap, difference, tau_statistic
from eaglenest.core.errors import EaglenestError, InputFileError, ParamsError
from eaglenest.stages.evaluate import _require_lossless, decoding_backends, write_eval_outputs
from eaglenest.stages.evaluate.job import ask_turns
from tests.fixtures.models import write_jsonl
from tests.fixtures.pipeline import REPO

MT_BENCH_SAMPLE = REPO / "tests" / "data" / "mt_bench_sample.jsonl"


def _prepared(tmp_path: Path, tokenizer, train_texts: list[str]) -> Path:
    rows = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}, {"role": "assistant", "content": "ok"}], tokenize=True
        )["input_ids"]
        for t in train_texts
    ]
    rows = [list(r) for r in rows]
    out = tmp_path / "prepared"
    val = [{"messages": [{"role": "user", "content": "the weather is nice"}], "origin": "chitchat:1"}]
    write_prepared(out, [*rows, rows[0]], [[1] * len(r) for r in [*rows, rows[0]]], len(rows), val)
    return out


@pytest.fixture
def prepared(tmp_path: Path, tiny_tokenizer) -> Path:
    return _prepared(tmp_path, tiny_tokenizer, ["hello there how are you today", "let us go for a walk"])


def test_a_set_must_share_no_prompt_with_training(tmp_path: Path, tiny_tokenizer, prepared: Path):
    general = write_jsonl(
        tmp_path / "general.jsonl", [{"prompt": "what is the capital of France?"}, {"prompt": "let us go for a walk"}]
    )
    params = EvalSetParams(name="general", source=str(general))
    with pytest.raises(
        InputFileError,
        match=r"general.jsonl\): prompt 2 \('let us go for a walk'\) is also in the "
        r"training rows",
    ):
        load_eval_set(params, prepared, tiny_tokenizer)
    write_jsonl(general, [{"prompt": "what is the capital of France?"}])
    assert len(load_eval_set(params, prepared, tiny_tokenizer).conversations) == 1
    # the held-out prompts are the val split itself: their category is the source they came from
    (val,) = load_eval_set(EvalSetParams(name="val", source="val"), prepared, tiny_tokenizer).conversations
    assert (val.id, val.category, val.turns) == ("chitchat:1", "chitchat", ["the weather is nice"])


def test_the_shipped_general_set_has_every_kind_and_is_well_formed():
    records = [json.loads(line) for line in GENERAL_SET_FILE.read_text().splitlines()]
    kinds = {r["kind"] for r in records}
    assert {"explanation", "how-to", "writing", "coding", "math", "trivia", "advice", "multi-turn"} <= kinds
    texts = [r.get("prompt") or r["messages"][0]["content"] for r in records]
    assert len(set(texts)) == len(texts) == 32
    sources = {s.source for s in parse_params({}).evaluate.sets if s.headline}
    assert sources == {"builtin:general", "builtin:humaneval", "builtin:long"}  # fixed files, never resampled


def test_the_shipped_long_set_is_what_its_snapshot_script_writes(tmp_path: Path):
    """data/eval/long.jsonl: long documents of three request kinds, each prompt 2,500+ characters; rewriting it
    with its script gives the same file (the snapshot is of this interpreter's documentation)."""
    import subprocess
    import sys

    records = [json.loads(line) for line in LONG_SET_FILE.read_text(encoding="utf-8").splitlines()]
    assert len(records) == 24 and {r["kind"] for r in records} == {"summarize", "explain", "answer"}
    assert len({r["id"] for r in records}) == 24 and min(len(r["prompt"]) for r in records) >= 2500
    out = tmp_path / "long.jsonl"
    script = REPO / "scripts" / "snapshot_long_documents.py"
    subprocess.run([sys.executable, str(script), "--out", str(out)], check=True, capture_output=True)
    if sys.version_info[:2] == (3, 11):  # the interpreter the snapshot was taken with
        assert out.read_text(encoding="utf-8") == LONG_SET_FILE.read_text(encoding="utf-8")


def test_question_jsonl_turns_are_asked_after_the_verifiers_own_answers(tiny_tokenizer, prepared: Path):
    eval_set = load_eval_set(EvalSetParams(name="mt", source=str(MT_BENCH_SAMPLE)), prepared, tiny_tokenizer)
    assert [(c.id, c.category, len(c.turns)) for c in eval_set.conversations] == [
        ("81", "writing", 2),
        ("111", "math", 2),
        ("131", "extraction", 2),
    ]
    seen: list[list[int]] = []

    def decode(prompts: list[list[int]]) -> list[list[int]]:
        first = len(seen) + 1
        seen.extend(prompts)
        return [
            tiny_tokenizer(f"ANSWER NUMBER {first + i}", add_special_tokens=False)["input_ids"]
            for i in range(len(prompts))
        ]

    turns, outputs = ask_turns(eval_set, eval_set.conversations, tiny_tokenizer, decode, lambda out: out)
    assert [(t.conversation.id, t.turn) for t in turns] == [
        ("81", 0),
        ("81", 1),
        ("111", 0),
        ("111", 1),
        ("131", 0),
        ("131", 1),
    ]
    assert len(seen) == 6 and len(outputs) == 6
    second = tiny_tokenizer.decode(turns[1].prompt)
    # turn 2 of question 81 holds its first question, the answer decoded for it, then its second question
    assert eval_set.conversations[0].turns[0] in second and "ANSWER NUMBER 1" in second
    assert second.index("ANSWER NUMBER 1") < second.index("Rewrite your previous response")


def test_humaneval_comes_from_the_installed_package_in_the_template_or_raw(tiny_tokenizer, prepared: Path):
    chat = load_eval_set(EvalSetParams(name="he", source="builtin:humaneval"), prepared, tiny_tokenizer)
    assert len(chat.conversations) == 164 and chat.conversations[0].id == "HumanEval/0"
    raw = load_eval_set(
        EvalSetParams(name="he", source="builtin:humaneval", num_prompts=3, chat_template=False),
        prepared,
        tiny_tokenizer,
    )
    problem = raw.conversations[0].turns[0]
    assert problem.lstrip().startswith("from typing import List")
    raw_ids = raw.render(raw.conversations[0], 0, [], tiny_tokenizer)
    chat_ids = chat.render(chat.conversations[0], 0, [], tiny_tokenizer)
    assert raw_ids == tiny_tokenizer(problem, add_special_tokens=False)["input_ids"] and len(chat_ids) > len(raw_ids)


def test_category_filter_and_count(tiny_tokenizer, prepared: Path):
    kept = load_eval_set(
        EvalSetParams(name="g", source="builtin:general", categories=["math", "coding"], num_prompts=3),
        prepared,
        tiny_tokenizer,
    )
    assert [c.category for c in kept.conversations] == ["coding", "math", "coding"]
    with pytest.raises(
        InputFileError,
        match=r"^evaluate.sets: g: .*general.jsonl: no record has a category among "
        r"\['poetry'\]$",
    ):
        load_eval_set(
            EvalSetParams(name="g", source="builtin:general", categories=["poetry"]), prepared, tiny_tokenizer
        )
    with pytest.raises(InputFileError, match="chat_template: false sends one raw completion per record"):
        load_eval_set(
            EvalSetParams(name="mt", source=str(MT_BENCH_SAMPLE), chat_template=False), prepared, tiny_tokenizer
        )


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            [{"name": "a", "source": "val", "headline": True}, {"name": "a", "source": "x.jsonl"}],
            "evaluate.sets: set name(s) a used twice",
        ),
        ([{"name": n, "source": "val", "headline": True} for n in "abcd"], "at most 3 may be headline"),
        ([{"name": "a", "source": "val"}], "no set has headline: true"),
        ([{"name": "a", "source": "builtin:mtbench", "headline": True}], "evaluate.sets.0.source = 'builtin:mtbench'"),
        ([{"name": "A b", "source": "val", "headline": True}], "evaluate.sets.0.name = 'A b'"),
    ],
)
def test_bad_sets_are_named_in_one_line(sets: list, message: str):
    with pytest.raises(ParamsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_params({"evaluate": {"sets": sets}})


def test_old_keys_say_where_they_moved():
    with pytest.raises(ParamsError) as raised:
        parse_params({"evaluate": {"general_prompts": "x.jsonl", "num_prompts": 3}})
    assert "evaluate.general_prompts moved to evaluate.sets" in str(raised.value)
    assert "evaluate.num_prompts moved to evaluate.sets (each set's num_prompts)" in str(raised.value)


def _records(n: int, accept: float, rng: np.random.Generator, k: int = 3) -> list[dict]:
    records = []
    for i in range(n):
        steps = int(rng.integers(10, 30))
        accepted = int(rng.binomial(steps * k, accept / k))
        per_position = [min(steps, accepted)] + [0] * (k - 1)
        spec_s, plain_s = float(rng.uniform(0.5, 1.0)), float(rng.uniform(0.8, 1.2))
        records.append(
            {
                "id": str(i),
                "turn": 1,
                "category": "ab"[i % 2],
                "steps": steps,
                "accepted": accepted,
                "drafted": steps * k,
                "per_position": per_position,
                "identical": True,
                "lossless": True,
                "plain_tokens": 32,
                "plain_s": plain_s,
                "spec_tokens": 32,
                "spec_s": spec_s,
                "ngram_tokens": 32,
                "ngram_s": plain_s,
                "ngram_steps": steps,
                "ngram_accepted": 1,
                "ngram_drafted": 3,
                "ngram_per_position": [1, 0, 0],
                "alone_steps": steps,
                "alone_accepted": max(accepted - 1, 0),
            }
        )
    return records


def test_the_interval_covers_the_figure_and_narrows_with_more_prompts():
    rng = np.random.default_rng(0)
    small, large = _records(20, 1.0, rng), _records(320, 1.0, rng)
    a, b = tau_interval(small, 1000, 0), tau_interval(large, 1000, 0)
    assert a.low <= a.value <= a.high and b.low <= b.value <= b.high
    assert b.half_width < a.half_width / 2.5  # 16x the prompts: about a quarter of the width
    # the same records resampled identically for both sides of a pair: the difference is exactly zero
    sums = np.array([[r["accepted"], r["steps"]] for r in small], dtype=float)
    same = bootstrap(np.concatenate([sums, sums], axis=1), difference(tau_statistic, 2), 500, 0)
    assert same.value == same.low == same.high == 0.0 and not same.excludes_zero()


def test_the_hybrid_is_paired_against_the_free_drafter_and_the_draft_and_a_lost_token_fails_the_stage(tmp_path: Path):
    rng = np.random.default_rng(2)
    records = _records(12, 1.2, rng)
    for record in records:
        # the hybrid decodes each timed turn in half the draft's seconds, and emitted plain's tokens
        record.update(
            hybrid_steps=record["steps"] - 2,
            hybrid_accepted=record["accepted"] + 2,
            hybrid_drafted=record["drafted"],
            hybrid_identical=True,
            hybrid_lossless=True,
            hybrid_tokens=32,
            hybrid_s=record["spec_s"] / 2,
            hybrid_timed_identical=True,
        )
    summary = summarize(records, 3, 200, 0, "ngram")
    assert summary["hybrid_vs_spec"]["value"] == pytest.approx(2.0) and summary["hybrid_vs_spec"]["verdict"] == "ahead"
    assert summary["hybrid_vs_free"]["drafter"] == "ngram" and summary["hybrid_vs_free"]["value"] == pytest.approx(
        2 * summary["vs_ngram"]["value"], rel=1e-3
    )
    assert summary["hybrid_lossless_fraction"] == summary["hybrid_timed_identical_fraction"] == 1.0
    params = EvaluateParams(sets=[EvalSetParams(name="humaneval", source="builtin:humaneval", headline=True)])
    run = {"dtype": "float32", "num_speculative_tokens": 3, "hybrid": {"measured": True, "why": "t"}}
    entry = {"source": "x", "temperature": 0.0, "max_new_tokens": 32, "records": records}
    details = write_eval_outputs(params, {"vllm": run | {"sets": {"humaneval": entry}}}, tmp_path / "e.json", tmp_path)
    figures = json.loads((tmp_path / "e.json").read_text())["humaneval"]
    assert figures["vllm_hybrid_vs_free"] == summary["hybrid_vs_free"]["value"] and "vllm_hybrid_speedup" in figures
    assert details["runs"]["vllm"]["hybrid"] == {"measured": True, "why": "t"}
    records[3]["hybrid_lossless"] = False
    with pytest.raises(
        EaglenestError, match="^lossless fraction of the hybrid = 0.9167 < 1.0 .*hybrid_lossless: false"
    ):
        _require_lossless(
            params, {"temperature": 0.0, "summary": summarize(records, 3, 200, 0)}, "vllm", "he", tmp_path
        )


def test_headline_is_a_few_named_numbers(tmp_path: Path):
    rng = np.random.default_rng(1)
    params = EvaluateParams(
        sets=[
            EvalSetParams(name="humaneval", source="builtin:humaneval", headline=True),
            EvalSetParams(name="val", source="val"),
        ],
        bootstrap_samples=200,
    )

    def run(dtype: str) -> dict:
        return {
            "dtype": dtype,
            "num_speculative_tokens": 3,
            "sets": {
                name: {"source": "x", "temperature": 0.0, "max_new_tokens": 32, "records": _records(12, 1.2, rng)}
                for name in ("humaneval", "val")
            },
        }

    details = write_eval_outputs(
        params, {"hf": run("float32"), "vllm": run("bfloat16")}, tmp_path / "eval.json", tmp_path / "eval"
    )
    figures = json.loads((tmp_path / "eval.json").read_text())
    assert figures == headline(details, ["humaneval"], "vllm")
    assert set(figures) == {"humaneval", "lossless"} and set(figures["humaneval"]) == {
        "vllm_tau",
        "vllm_tau_ci95",
        "vllm_speedup",
        "vllm_speedup_ci95",
        "vllm_vs_free",
        "vllm_vs_free_ci95",
        "vllm_free",
        "vllm_tau_timed",
        "vllm_ngram_speedup",
    }
    summary = details["runs"]["vllm"]["sets"]["humaneval"]["summary"]
    # n-gram decoded each turn as fast as plain decoding here: the draft's speed over n-gram's is its speed-up; with
    # no free_sweep record naming another, n-gram drafting is the free drafter the verdict is against
    assert figures["humaneval"]["vllm_vs_free"] == pytest.approx(figures["humaneval"]["vllm_speedup"], abs=1e-4)
    assert figures["humaneval"]["vllm_free"] == "ngram" and summary["vs_free"]["verdict"] == "ahead"
    assert summary["vs_free"] == summary["vs_ngram"] | {"drafter": "ngram"}
    assert figures["humaneval"]["vllm_tau_timed"] == summary["tau_batched_vs_alone"]["alone"]["value"]
    assert figures["humaneval"]["vllm_tau"] == summary["tau"]["value"] and set(summary["categories"]) == {"a", "b"}
    moved = summary["tau_batched_vs_alone"]  # one accepted token fewer per turn when decoded alone
    assert moved["alone"]["value"] < moved["batched"]["value"] == summary["tau"]["value"]
    assert summary == summarize(
        json.loads((tmp_path / "eval/records.json").read_text())["runs"]["vllm"]["sets"]["humaneval"]["records"],
        3,
        200,
        0,
    )
    rows = json.loads((tmp_path / "eval/acceptance.json").read_text())
    assert {(r["set"], r["drafter"]) for r in rows} == {
        (s, d) for s in ("humaneval", "val") for d in ("eagle3", "ngram")
    }


def test_only_vllm_decodes_a_draft_the_reference_decoder_does_not():
    """The hf back end's reference decoder is EAGLE-3's: a P-EAGLE or DFlash draft is measured by vllm alone, and
    refused in one line when vllm is not listed."""
    both = EvaluateParams(backend=["hf", "vllm"])
    assert decoding_backends(both, "eagle3") == ["hf", "vllm"]
    assert decoding_backends(both, "peagle") == decoding_backends(both, "dflash") == ["vllm"]
    with pytest.raises(
        EaglenestError,
        match=r"evaluate.backend: \[hf\] decodes EAGLE-3 drafts only, and the draft "
        r"is dflash \(train.algorithm\); add vllm to evaluate.backend",
    ):
        decoding_backends(EvaluateParams(backend=["hf"]), "dflash")


@pytest.mark.parametrize(("draft_s", "verdict_said"), [(0.8, "ahead"), (1.25, "behind"), (None, "tie")])
def test_the_verdict_pairs_the_draft_with_n_gram_turn_by_turn(draft_s: float | None, verdict_said: str):
    """The draft's tokens/s over n-gram's on the turns both decoded alone, paired by conversation: ahead where the
    95% interval lies above 1, behind where below, a tie where it holds 1."""
    rng = np.random.default_rng(2)
    records = _records(16, 1.2, rng)
    for i, record in enumerate(records):
        record["ngram_s"] = round(float(rng.uniform(0.8, 1.2)), 6)
        # a tie: the draft a tenth faster on half the conversations, a tenth slower on the others
        record["spec_s"] = record["ngram_s"] * (draft_s if draft_s is not None else (0.9 if i % 2 else 1.1))
    versus = draft_vs_free(records, 1000, 0)
    assert verdict(versus) == verdict_said
    assert summarize(records, 3, 1000, 0)["vs_ngram"] == versus.as_dict() | {"verdict": verdict_said}
    untimed = [{**r, "ngram_s": None} for r in records]
    assert draft_vs_free(untimed, 1000, 0) is None and "vs_ngram" not in summarize(untimed, 3, 1000, 0)
    # the same turns as suffix decoding's: the verdict is against the free drafter named fastest
    as_suffix = [{**r, "suffix_tokens": r["ngram_tokens"], "suffix_s": r["ngram_s"], "ngram_s": None} for r in records]
    summary = summarize(as_suffix, 3, 1000, 0, free="suffix")
    assert summary["vs_free"] == versus.as_dict() | {"verdict": verdict_said, "drafter": "suffix"}
    assert "vs_free" not in summarize(as_suffix, 3, 1000, 0, free="ngram")
