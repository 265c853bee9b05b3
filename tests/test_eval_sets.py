"""The evaluation sets: val and general, the general set disjoint from training, and metrics per set and back
end under flat names (what `dvc metrics diff` shows)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eaglenest.artifacts.prepared import write_prepared
from eaglenest.core.errors import InputFileError
from eaglenest.core.params import EvaluateParams, parse_params
from eaglenest.stages.evaluate import flat_metrics, write_eval_outputs
from eaglenest.stages.evaluate.prompts import load_prompt_sets

from .conftest import write_jsonl

REPO = Path(__file__).resolve().parents[1]


def _prepared(tmp_path: Path, tokenizer, train_texts: list[str]) -> Path:
    rows = [tokenizer.apply_chat_template([{"role": "user", "content": t}, {"role": "assistant", "content": "ok"}],
                                          tokenize=True)["input_ids"] for t in train_texts]
    rows = [list(r) for r in rows]
    out = tmp_path / "prepared"
    val = [{"messages": [{"role": "user", "content": "the weather is nice"}], "origin": "x:1"}]
    write_prepared(out, [*rows, rows[0]], [[1] * len(r) for r in [*rows, rows[0]]], len(rows), val)
    return out


def test_the_general_set_must_share_no_prompt_with_training(tmp_path: Path, tiny_tokenizer):
    prepared = _prepared(tmp_path, tiny_tokenizer, ["hello there how are you today", "let us go for a walk"])
    general = write_jsonl(tmp_path / "general.jsonl", [{"prompt": "what is the capital of France?"},
                                                       {"prompt": "let us go for a walk"}])
    params = EvaluateParams(general_prompts=str(general))
    with pytest.raises(InputFileError, match=r"general.jsonl\): prompt 2 \('let us go for a walk'\) is also in the "
                                             r"training rows"):
        load_prompt_sets(params, prepared, tiny_tokenizer)
    write_jsonl(general, [{"prompt": "what is the capital of France?"}])
    sets = load_prompt_sets(params, prepared, tiny_tokenizer)
    assert list(sets) == ["val", "general"] and len(sets["general"]) == 1
    assert list(load_prompt_sets(EvaluateParams(general_prompts=None), prepared, tiny_tokenizer)) == ["val"]


def test_the_shipped_general_set_has_every_kind_and_is_well_formed(tiny_tokenizer):
    path = REPO / parse_params({}).evaluate.general_prompts
    records = [json.loads(line) for line in path.read_text().splitlines()]
    kinds = {r["kind"] for r in records}
    assert {"explanation", "how-to", "writing", "coding", "math", "trivia", "advice", "multi-turn"} <= kinds
    # The default num_prompts takes the first lines: they must span the kinds, not one of them.
    first = [r["kind"] for r in records[: EvaluateParams().num_prompts]]
    assert len(set(first)) >= 7, first
    texts = [r.get("prompt") or r["messages"][0]["content"] for r in records]
    assert len(set(texts)) == len(texts)


def _set_metrics(tau: float, backend: str) -> dict:
    return {"tau": tau, "per_position_acceptance": [0.5, 0.25], "speedup": 1.5, "lossless_fraction": 1.0,
            "tau_ngram": 1.1, "per_position_acceptance_ngram": [0.1, 0.0], "num_speculative_tokens": 2,
            "backend": backend}


def test_flat_names_per_set_and_back_end(tmp_path: Path):
    results = {"hf": {"val": _set_metrics(2.5, "hf"), "general": _set_metrics(2.0, "hf")},
               "vllm": {"val": _set_metrics(2.4, "vllm"), "general": _set_metrics(1.9, "vllm")}}
    flat = flat_metrics(results, "hf")
    assert flat["tau"] == flat["tau_val"] == 2.5 and flat["backend"] == "hf"  # the primary's val figures, as before
    assert (flat["tau_general"], flat["vllm_tau_val"], flat["vllm_tau_general"]) == (2.0, 2.4, 1.9)
    assert flat["acceptance_pos_2_general"] == 0.25 and flat["vllm_speedup_general"] == 1.5
    assert flat["sets"]["general"]["vllm"]["tau"] == 1.9
    written = write_eval_outputs(results, "hf", tmp_path / "eval.json", tmp_path / "plots")
    assert json.loads((tmp_path / "eval.json").read_text()) == written
    tau_rows = json.loads((tmp_path / "plots" / "tau.json").read_text())
    assert [r["drafter"] for r in tau_rows][:4] == ["eagle3 hf val", "ngram hf val", "eagle3 hf general",
                                                     "ngram hf general"]
    series = [r["series"] for r in json.loads((tmp_path / "plots" / "acceptance.json").read_text())]
    assert len(series) == len(set(series)) == 16  # 2 back ends x 2 sets x 2 drafters x K=2, each its own bar
