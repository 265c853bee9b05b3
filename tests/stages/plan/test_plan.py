"""The plan stage and its record: the cheapest method whose interval reaches the fastest's, for this draft."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from eaglenest.artifacts.draft_hash import draft_fingerprint
from eaglenest.artifacts.eval_params import EvalSetParams, EvaluateParams
from eaglenest.artifacts.serving_plan import choose_method, planned_method
from eaglenest.core.errors import InputFileError
from eaglenest.stages.evaluate import write_eval_outputs
from eaglenest.stages.plan import PlanPaths, PlanStageParams, plan


def test_the_cheapest_method_whose_interval_reaches_the_fastest_is_served():
    # the hybrid is fastest, the draft's interval reaches it: the draft, the cheaper, stands
    method, why = choose_method({"ngram": (1.3, 1.2, 1.4), "draft": (1.5, 1.4, 1.62), "hybrid": (1.6, 1.55, 1.7)})
    assert method == "draft" and why.startswith("hybrid was fastest (x1.600") and "the cheaper method stands" in why
    # clear of every cheaper one: the fastest stands
    assert choose_method({"suffix": (1.3, 1.2, 1.4), "hybrid": (1.8, 1.7, 1.9)})[0] == "hybrid"
    # nothing faster than plain decoding beyond its interval: plain decoding
    assert choose_method({"draft": (1.05, 0.9, 1.2)})[0] == "plain"
    # every method slower than plain: plain is the fastest
    method, why = choose_method({"draft": (0.9, 0.85, 0.95)})
    assert method == "plain" and why.startswith("plain was fastest")


def _draft(folder: Path, weights: bytes = b"w") -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(
        json.dumps(
            {
                "speculators_model_type": "eagle3",
                "speculators_config": {"proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 2}]},
            }
        )
    )
    (folder / "model.safetensors").write_bytes(weights)
    return folder


def _records(rng: np.random.Generator, hybrid_s: float) -> list[dict]:
    """Timed turns: plain at 1 s, the draft at 0.8 s, the hybrid at ``hybrid_s``, n-gram at 0.9 s (32 tokens each),
    with a little spread."""
    records = []
    for i in range(10):
        jitter = float(rng.uniform(0.98, 1.02))
        record = {"id": str(i), "turn": 1, "steps": 10, "accepted": 5, "drafted": 20, "per_position": [5, 0]}
        record |= {"identical": True, "lossless": True}
        for drafter, seconds in (("plain", 1.0), ("spec", 0.8), ("hybrid", hybrid_s), ("ngram", 0.9)):
            record[f"{drafter}_tokens"], record[f"{drafter}_s"] = 32, seconds * jitter
        records.append(record)
    return records


def test_the_stage_plans_from_evaluates_timed_turns_for_this_draft_and_serve_reads_it_only_for_it(tmp_path: Path):
    rng = np.random.default_rng(0)
    sets = [EvalSetParams(name=n, source="builtin:general", headline=True) for n in ("a", "b")]
    params = EvaluateParams(sets=sets, bootstrap_samples=200)
    run = {
        "dtype": "float32",
        "num_speculative_tokens": 2,
        "hybrid": {"measured": True, "setting": {"draft_k": 2}, "why": "t"},
        "sets": {
            n: {"source": "x", "temperature": 0.0, "max_new_tokens": 32, "records": _records(rng, 0.5)} for n in "ab"
        },
    }
    write_eval_outputs(params, {"vllm": run}, tmp_path / "eval.json", tmp_path / "eval")
    draft = _draft(tmp_path / "draft")
    paths = PlanPaths(draft, tmp_path / "eval", tmp_path / "absent.json", tmp_path / "serving_plan.json")
    assert plan(PlanStageParams(evaluate=params), paths) == {"method": "hybrid"}
    record = json.loads(paths.out.read_text())
    assert record["draft_sha256"] == draft_fingerprint(draft) and record["sets"] == ["a", "b"]
    assert record["pooled"]["hybrid"]["value"] == pytest.approx(2.0, rel=0.01)
    assert record["pooled"]["draft"]["value"] == pytest.approx(1.25, rel=0.01)
    assert set(record["pooled"]) == {"ngram", "draft", "hybrid"}  # suffix decoding was not timed
    assert record["draft"]["k"] == 2 and record["hybrid"] == {"draft_k": 2} and record["schedule"] is None
    assert planned_method(draft_fingerprint(draft), paths.out)[0] == "hybrid"
    method, why = planned_method("0" * 64, paths.out)
    assert method is None and "was made for another draft" in why
    assert planned_method("0" * 64, tmp_path / "none.json") == (
        None,
        f"no {tmp_path / 'none.json'}; `dvc repro plan` makes one",
    )
    paths.out.write_text(json.dumps({"method": "fastest"}))
    with pytest.raises(InputFileError, match="serving_plan.json: not a serving plan"):
        planned_method("0" * 64, paths.out)


def test_a_run_without_the_vllm_back_end_plans_the_draft(tmp_path: Path):
    rng = np.random.default_rng(1)
    params = EvaluateParams(sets=[EvalSetParams(name="a", source="builtin:general", headline=True)], backend=["hf"])
    entry = {"source": "x", "temperature": 0.0, "max_new_tokens": 32, "records": _records(rng, 0.5)}
    run = {"dtype": "float32", "num_speculative_tokens": 2, "sets": {"a": entry}}
    write_eval_outputs(params, {"hf": run}, tmp_path / "eval.json", tmp_path / "eval")
    paths = PlanPaths(_draft(tmp_path / "draft"), tmp_path / "eval", tmp_path / "absent.json", tmp_path / "plan.json")
    assert plan(PlanStageParams(evaluate=params), paths) == {"method": "draft"}
    record = json.loads(paths.out.read_text())
    assert record["pooled"] == {} and "no vllm back end" in record["why"] and record["hybrid"] is None
