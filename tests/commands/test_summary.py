"""``eaglenest summary``: the headline figures as the short table ``make demo`` ends with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eaglenest.commands.cli import main


def test_summary_is_one_row_per_headline_set(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    (tmp_path / "metrics" / "eval").mkdir(parents=True)
    (tmp_path / "metrics" / "eval.json").write_text(
        json.dumps(
            {
                "humaneval": {
                    "vllm_tau": 1.8,
                    "vllm_tau_ci95": 0.03,
                    "vllm_speedup": 1.2,
                    "vllm_speedup_ci95": 0.05,
                    "vllm_vs_free": 1.333,
                    "vllm_vs_free_ci95": 0.06,
                },
                "general": {"vllm_tau": 1.5, "vllm_tau_ci95": 0.07},
                "lossless": 1.0,
            }
        )
    )
    (tmp_path / "metrics" / "train.json").write_text(json.dumps({"tau_sim": 2.04, "val_loss_all_tokens": 4.5}))
    host = {"cpu": "AMD EPYC", "aten_capability": "AVX2", "bf16_native": False, "gpu": None, "compute_dtype": "float32"}
    sets = {
        "val": {"summary": {"tau": {"value": 1.9, "ci95": 0.08}}},
        "humaneval": {
            "summary": {
                "ngram_speedup": {"value": 0.9, "ci95": 0.04},
                "vs_free": {"verdict": "ahead", "drafter": "suffix"},
            }
        },
    }
    details = {"headline_backend": "vllm", "host": host, "runs": {"vllm": {"sets": sets}}}
    (tmp_path / "metrics" / "eval" / "details.json").write_text(json.dumps(details))
    assert main(["summary", "--repo", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "set",
        "vllm",
        "tau",
        "(95%)",
        "speed-up",
        "(95%)",
        "n-gram",
        "speed-up",
        "(95%)",
        "suffix",
        "speed-up",
        "(95%)",
        "draft",
        "/",
        "fastest",
        "free",
        "(95%)",
    ]
    assert lines[1].split() == [
        "humaneval",
        "1.800",
        "±",
        "0.030",
        "x1.200",
        "±",
        "0.050",
        "x0.900",
        "±",
        "0.040",
        "—",
        "x1.333",
        "±",
        "0.060",
        "ahead",
        "(suffix)",
    ]
    assert lines[2].split() == ["general", "1.500", "±", "0.070", "—", "—", "—", "—"]
    assert lines[3] == "lossless: 1.0"
    assert "tau_sim 2.040" in lines[4] and "decoded tau of the same split (vllm): 1.900 ± 0.080" in lines[4]
    assert lines[5] == "measured on: AMD EPYC, AVX2 (no native bf16), computing in float32"


def test_summary_before_the_pipeline_ran_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["summary", "--repo", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "metrics/eval.json: not found; run the pipeline first" in err


def test_summary_ends_with_the_k_served_and_the_k_per_batch_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], pipeline_folders
):
    from tests.fixtures.bench import schedule_record

    (tmp_path / "metrics").mkdir(exist_ok=True)
    (tmp_path / "metrics" / "eval.json").write_text(json.dumps({"lossless": 1.0}))
    (tmp_path / "metrics" / "train.json").write_text(json.dumps({}))
    assert main(["summary", "--repo", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("served K: 3 (the draft's own: no ")
    assert lines[-1].startswith("K per batch size: none, the same K at every batch size (no ")
    record = schedule_record(tmp_path / "metrics" / "serve_schedule.json", tmp_path / "models" / "draft")
    assert main(["summary", "--repo", str(tmp_path)]) == 0
    assert (
        capsys.readouterr()
        .out.splitlines()[-1]
        .startswith("K per batch size: K 3 at 1-4, 0 at 5-128 (measured for this draft by eaglenest bench at abc1234")
    )
    record.write_text("{")
    assert main(["summary", "--repo", str(tmp_path)]) == 0
    assert (
        capsys.readouterr()
        .out.splitlines()[-1]
        .startswith(f"K per batch size: {record}: not a serve schedule record (JSONDecodeError")
    )
