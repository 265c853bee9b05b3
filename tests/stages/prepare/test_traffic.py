"""prepare's traffic:<dir> source: the split by time, duplicates of evaluation prompts and of held-out requests left
out of training, weighting by acceptance, and the evaluate set source: traffic that reads the held-out slice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from datasets import load_from_disk

from eaglenest.artifacts.eval_params import EvalSetParams
from eaglenest.artifacts.eval_prompts import shipped_evaluation_prompts
from eaglenest.artifacts.eval_sets import load_eval_set
from eaglenest.artifacts.prepared import TRAFFIC_HELD_OUT_FILE
from eaglenest.artifacts.traffic import TrafficWriter
from eaglenest.core.chat import end_of_turn_ids
from eaglenest.core.errors import InputFileError, ParamsError
from eaglenest.core.params import parse_sections
from eaglenest.stages.prepare import prepare_dataset
from eaglenest.stages.prepare.params import PrepareParams, PrepareStageParams
from eaglenest.stages.prepare.traffic import NearDuplicates
from tests.fixtures.models import write_jsonl

TOPICS = ["apples", "rivers", "engines", "castles", "violins", "glaciers", "bridges", "comets", "lanterns", "ferns"]


def prompt(i: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    return f"request {i}: please tell me three short facts about {topic} number {i * 7919 % 1000}"


def record(i: int, text: str, rate: float | None = None, minute: int | None = None) -> dict:
    acceptance = None
    if rate is not None:
        acceptance = {
            "mean_acceptance_length": 1 + 2 * rate,
            "draft_acceptance_rate": rate,
            "num_spec_steps": 10,
            "num_draft_tokens": 20,
            "num_accepted_draft_tokens": int(20 * rate),
            "num_spec_tokens": 2,
        }
    return {
        "version": 1,
        "time": f"2026-12-01T10:{minute if minute is not None else i:02d}:00.000000Z",
        "endpoint": "chat",
        "model": "tiny",
        "draft": "d" * 64,
        "k": 2,
        "messages": [{"role": "user", "content": text}],
        "prompt": None,
        "reply": f"fact {i}",
        "finish_reason": "stop",
        "usage": None,
        "acceptance": acceptance,
    }


def record_folder(folder: Path, records: list[dict]) -> Path:
    writer = TrafficWriter(folder)
    try:
        for line in records:
            writer.append(line)
    finally:
        writer.close()
    return folder


def training_texts(out: Path, tokenizer) -> list[str]:
    return [tokenizer.decode(ids) for ids in load_from_disk(str(out)).with_format(None)["input_ids"]]


def run_prepare(tmp_path: Path, tokenizer, source: list, name: str = "prepared", **params) -> tuple[Path, dict]:
    out = tmp_path / name
    settings = {"max_conversations": None, "max_len": 512, "val_fraction": 0.1, "seed": 0, **params}
    metrics = prepare_dataset(
        PrepareParams(source=source, **settings), tokenizer, out, tmp_path / f"{name}.json", end_of_turn_ids(tokenizer)
    )
    return out, metrics


def test_the_latest_share_is_held_out_and_never_trained_on(tmp_path: Path, tiny_tokenizer):
    """20 requests, held_out 0.25: the 5 latest by time (not by file order) are the held-out slice, written for
    evaluation, and none of them is in a training or validation row; the counts say so."""
    lines = [record(i, prompt(i)) for i in range(20)]
    folder = record_folder(tmp_path / "traffic", lines[10:] + lines[:10])  # file order is not time order
    out, metrics = run_prepare(tmp_path, tiny_tokenizer, [{"source": f"traffic:{folder}", "held_out": 0.25}])

    held = [json.loads(line) for line in (out / TRAFFIC_HELD_OUT_FILE).read_text().splitlines()]
    assert [h["messages"][0]["content"] for h in held] == [prompt(i) for i in range(15, 20)]
    assert all(h["category"] == "traffic" and h["id"].startswith("traffic:traffic-000001.jsonl:") for h in held)
    rows = training_texts(out, tiny_tokenizer)
    assert len(rows) == 15
    assert not any(prompt(i) in row for row in rows for i in range(15, 20))
    assert all(any(prompt(i) in row for row in rows) for i in range(15))
    traffic = metrics["traffic"]
    assert (traffic["requests"], traffic["held_out"], traffic["train"]) == (20, 5, 15)
    assert traffic["held_out_from"] == "2026-12-01T10:15:00.000000Z"


def test_duplicates_of_evaluation_and_held_out_prompts_never_reach_training(tmp_path: Path, tiny_tokenizer):
    """A request that is a shipped evaluation prompt (or quotes one whole), a near copy of a held-out request with
    one word changed, and a request asked twice (counted once, at its latest time, so held out) are all kept out
    of training."""
    humaneval = next(text for name, text in shipped_evaluation_prompts() if name.startswith("humaneval"))
    held_text = "please write a careful summary of the history of the printing press in europe and asia"
    lines = [record(i, prompt(i)) for i in range(12)]
    lines += [
        record(12, humaneval),
        record(13, "Fix this for me:\n" + humaneval),
        record(14, held_text.replace("careful", "thorough")),  # near copy, early: a training candidate
        record(15, prompt(3)),  # asked again later than its first time
        record(16, held_text),
        record(17, prompt(16)),
    ]
    folder = record_folder(tmp_path / "traffic", lines)
    out, metrics = run_prepare(tmp_path, tiny_tokenizer, [{"source": f"traffic:{folder}", "held_out": 0.2}])

    held = [
        json.loads(line)["messages"][0]["content"] for line in (out / TRAFFIC_HELD_OUT_FILE).read_text().splitlines()
    ]
    assert held == [prompt(3), held_text, prompt(16)]  # the 3 latest of 15 distinct, non-evaluation requests
    rows = training_texts(out, tiny_tokenizer)
    assert not any("printing press" in row for row in rows)
    assert not any(humaneval.strip()[:40] in row for row in rows)
    assert not any(prompt(3) in row for row in rows)
    traffic = metrics["traffic"]
    assert traffic["duplicates"] == 1
    assert traffic["near_evaluation_prompts"] == 2
    assert traffic["near_held_out"] == 1


def test_near_duplicates_by_shared_word_pairs():
    """One changed word in a long prompt, or the prompt quoted inside a longer one, is a near duplicate; a different
    prompt on the same topic is not, and short texts are compared exactly only."""
    base = "explain how a steam engine converts heat into motion and why the condenser matters so much"
    index = NearDuplicates([base])
    assert index.matches(base.upper() + "!")
    assert index.matches(base.replace("so much", "a lot"))
    assert index.matches("my teacher asked: " + base + " -- can you answer it in two lines?")
    assert not index.matches("explain how a jet engine works and why its compressor matters")
    assert not NearDuplicates(["hello there"]).matches("hello there friend")


def test_weight_by_acceptance_picks_what_the_draft_accepted_least(tmp_path: Path, tiny_tokenizer):
    """40 requests, half accepted at 0.9 and half at 0.05; a quota of 10: weighted by acceptance nearly all picks
    are the weak half, unweighted about half are."""
    lines = [record(i, prompt(i), rate=0.9 if i % 2 else 0.05) for i in range(40)]
    folder = record_folder(tmp_path / "traffic", lines)
    weak = {prompt(i) for i in range(40) if i % 2 == 0}

    def weak_share(weight_by: str | None, name: str) -> float:
        source = [{"source": f"traffic:{folder}", "held_out": 0.0, "weight_by": weight_by}]
        out, _ = run_prepare(tmp_path, tiny_tokenizer, source, name, max_conversations=10)
        rows = training_texts(out, tiny_tokenizer)
        return sum(any(p in row for p in weak) for row in rows) / len(rows)

    assert weak_share("acceptance", "weighted") >= 0.8
    assert weak_share(None, "uniform") <= 0.7


def test_traffic_at_weight_zero_is_evaluated_but_adds_no_row(tmp_path: Path, tiny_tokenizer):
    """Weight 0 writes the held-out slice and leaves the training rows exactly those of the mix without it: how a
    draft trained before the traffic was recorded is measured on it."""
    conversations = write_jsonl(
        tmp_path / "c.jsonl",
        [
            {"messages": [{"role": "user", "content": prompt(100 + i)}, {"role": "assistant", "content": "ok"}]}
            for i in range(12)
        ],
    )
    folder = record_folder(tmp_path / "traffic", [record(i, prompt(i)) for i in range(10)])
    without, _ = run_prepare(tmp_path, tiny_tokenizer, [str(conversations)], "without")
    with_traffic, metrics = run_prepare(
        tmp_path, tiny_tokenizer, [str(conversations), {"source": f"traffic:{folder}", "weight": 0}], "with"
    )
    assert training_texts(with_traffic, tiny_tokenizer) == training_texts(without, tiny_tokenizer)
    assert len((with_traffic / TRAFFIC_HELD_OUT_FILE).read_text().splitlines()) == 2  # the default share, 0.2
    assert not (without / TRAFFIC_HELD_OUT_FILE).exists()
    assert metrics["traffic"]["held_out"] == 2


def test_the_evaluate_set_reads_the_held_out_slice_and_names_what_is_missing(tmp_path: Path, tiny_tokenizer):
    """source: traffic is the held-out slice, checked disjoint from training like any set; prepared data without a
    traffic source is refused in one line that says how to get one."""
    folder = record_folder(tmp_path / "traffic", [record(i, prompt(i)) for i in range(10)])
    out, _ = run_prepare(tmp_path, tiny_tokenizer, [{"source": f"traffic:{folder}", "held_out": 0.3}])
    eval_set = load_eval_set(EvalSetParams(name="traffic", source="traffic"), out, tiny_tokenizer)
    assert [c.turns for c in eval_set.conversations] == [[prompt(i)] for i in range(7, 10)]
    assert {c.category for c in eval_set.conversations} == {"traffic"}

    plain = write_jsonl(
        tmp_path / "c.jsonl",
        [
            {"messages": [{"role": "user", "content": prompt(i)}, {"role": "assistant", "content": "ok"}]}
            for i in range(5)
        ],
    )
    other, _ = run_prepare(tmp_path, tiny_tokenizer, [str(plain)], "other")
    with pytest.raises(InputFileError, match="source traffic is the held-out slice of a traffic:<dir> source"):
        load_eval_set(EvalSetParams(name="traffic", source="traffic"), other, tiny_tokenizer)


def test_traffic_settings_elsewhere_and_two_traffic_sources_are_refused_together(tmp_path: Path):
    """held_out and weight_by on a file source, and two traffic folders, are each one line of one refusal."""
    params = {
        "prepare": {
            "source": [
                {"source": "data/conversations/x.jsonl", "held_out": 0.1, "weight_by": "acceptance"},
                "traffic:data/traffic",
                "traffic:data/traffic-b",
            ]
        }
    }
    with pytest.raises(ParamsError) as refused:
        parse_sections(params, PrepareStageParams)
    message = str(refused.value)
    assert "held_out applies to a traffic:<dir> source only" in message
    assert "weight_by applies to a traffic:<dir> source only" in message
    assert "lists 2 traffic sources" in message


def test_a_folder_without_chat_requests_is_refused(tmp_path: Path, tiny_tokenizer):
    """Completion requests alone (what eaglenest bench sends) give prepare nothing to learn from: one line."""
    line = {**record(0, "x"), "endpoint": "completion", "messages": None, "prompt": "def f():"}
    folder = record_folder(tmp_path / "traffic", [line])
    with pytest.raises(InputFileError, match="none of its 1 requests is a chat request"):
        run_prepare(tmp_path, tiny_tokenizer, [f"traffic:{folder}"])
