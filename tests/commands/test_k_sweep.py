"""`eaglenest k-sweep`: choosing K by measurement, and `eaglenest serve` using the K measured for its draft.
Fast tests drive the sweep with a fake engine timer; the slow one runs vLLM's CPU build on the tiny pipeline."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from eaglenest.commands import cli, k_sweep
from eaglenest.commands.k_sweep import PipelinePaths, TimedTurns, add_speedups, best_ks, draft_fingerprint
from tests.conftest import requires_vllm
from tests.fixtures.pipeline import SharedPipeline, project_env


def _draft(folder: Path, k: int = 3, weights: bytes = b"weights") -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "speculators_model_type": "eagle3",
        "speculators_config": {"proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}]},
    }))
    (folder / "model.safetensors").write_bytes(weights)
    return folder


def _entry(tokens_per_s: float, turns: int = 4) -> dict:
    return {"tokens_per_s": tokens_per_s, "turns": [[64, 64 / tokens_per_s]] * turns}


def _round(speedups: dict[str, dict[int, float]], ngram: float = 1.0) -> dict:
    """One round: plain at 10 tok/s on every set, the draft at each K as given, n-gram flat."""
    names = list(speedups)
    ks = list(next(iter(speedups.values())))
    return {"plain": {n: _entry(10.0) for n in names},
            "draft": {str(k): {n: {"speedup": speedups[n][k]} for n in names} for k in ks},
            "ngram": {str(k): {n: {"speedup": ngram} for n in names} for k in ks}}


def test_best_k_per_set_and_the_k_to_serve():
    rounds = [_round({"code": {1: 1.1, 2: 1.5, 3: 1.2}, "chat": {1: 1.3, 2: 1.2, 3: 1.0}}),
              _round({"code": {1: 1.1, 2: 1.4, 3: 1.2}, "chat": {1: 1.3, 2: 1.25, 3: 1.0}})]
    best, serve_k = best_ks(rounds, ["code", "chat"], [1, 2, 3])
    assert best["code"]["draft"]["k"] == 2 and best["code"]["draft"]["mean_speedup"] == pytest.approx(1.45)
    assert best["chat"]["draft"]["k"] == 1
    assert best["chat"]["draft"]["mean_speedup_per_k"] == {"1": 1.3, "2": 1.225, "3": 1.0}
    assert serve_k == 2  # mean over the sets: K=1 1.2, K=2 1.3375, K=3 1.1


def test_a_tie_serves_the_smaller_k():
    _, serve_k = best_ks([_round({"a": {1: 1.2, 2: 1.2}})], ["a"], [1, 2])
    assert serve_k == 1


def test_speed_up_interval_over_paired_turns():
    plain = {"s": {"tokens_per_s": 10.0, "turns": [[64, 6.4]] * 6}}
    steady = {"s": {"tokens_per_s": 20.0, "turns": [[64, 3.2]] * 6}}
    add_speedups(steady, plain)
    assert steady["s"]["speedup"] == 2.0 and steady["s"]["speedup_ci95"] == 0.0  # every turn x2: no spread
    uneven = {"s": {"tokens_per_s": 15.0, "turns": [[64, 2.0], [64, 6.0], [64, 3.0], [64, 5.0], [64, 4.0],
                                                     [64, 5.6]]}}
    add_speedups(uneven, plain)
    assert 0.05 < uneven["s"]["speedup_ci95"] < 1.0


def test_the_sweep_records_the_fastest_k_and_serve_uses_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys,
                                                           pipeline_folders):
    verifier, draft = pipeline_folders
    # the draft is fastest at K=2 on both sets, n-gram at K=1; plain decodes at 10 tok/s
    rates = {"the verifier": 10.0}
    rates |= {f"the draft, K={k}": r for k, r in ((1, 12.0), (2, 15.0), (3, 13.0))}
    rates |= {f"n-gram drafting, K={k}": r for k, r in ((1, 10.5), (2, 9.0), (3, 8.0))}
    started: list[str] = []
    timed_beside: list[list[str]] = []

    def fake_start_engine(turns, extra, what):
        started.append(what)
        return what  # the engine stands for its rate

    def fake_time_together(turns, engines):
        timed_beside.append(list(engines))
        return {name: {n: {**_entry(rates[what]), "tokens": 256, "seconds": 256 / rates[what]} for n in turns.prompts}
                for name, (what, _) in engines.items()}

    fake_turns = TimedTurns(params=type("P", (), {"seed": 0, "timed_prompts": 4, "ngram_prompt_lookup_min": None,
                                                  "ngram_prompt_lookup_max": None})(),
                            sets=[type("S", (), {"name": n})() for n in ("humaneval", "general")],
                            prompts={"humaneval": [[1]] * 4, "general": [[1]] * 4}, trained_k=3, common={})
    monkeypatch.setattr(k_sweep, "timed_turns", lambda paths, max_k=None: fake_turns)
    monkeypatch.setattr(k_sweep, "start_engine", fake_start_engine)
    monkeypatch.setattr(k_sweep, "time_together", fake_time_together)
    monkeypatch.setattr("eaglenest.stages.evaluate.vllm.close_engine", lambda llm: None)
    out = tmp_path / "metrics" / "k_sweep.json"
    assert cli.main(["k-sweep", "--draft", str(draft), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "serve_k 2 (the draft's own K is 3)" in printed
    assert "humaneval: draft K=1 x1.2, K=2 x1.5, K=3 x1.3" in printed
    engines = [f"{m}, K={k}" for k in (1, 2, 3) for m in ("the draft", "n-gram drafting")]
    assert started == ["the verifier", *engines]  # plain once, then each K's two engines
    assert timed_beside == [["plain", "draft", "ngram"]] * 3  # each K's two timed beside the plain engine
    result = json.loads(out.read_text())
    assert result["serve_k"] == 2 and result["ks"] == [1, 2, 3]
    assert result["draft"]["sha256"] == draft_fingerprint(draft) and result["draft"]["algorithm"] == "eagle3"
    assert result["best"]["general"]["ngram"]["k"] == 1
    assert result["rounds"][0]["draft"]["2"]["general"]["speedup"] == 1.5

    def served_k(*extra: str) -> tuple[int, str]:
        assert cli.main(["serve", "--verifier", str(verifier), "--draft", str(draft), "--print-command",
                         "--k-sweep", str(out), *extra]) == 0
        captured = capsys.readouterr()
        argv = shlex.split(captured.out.strip())
        config = json.loads(argv[argv.index("--speculative-config") + 1])
        return config["num_speculative_tokens"], captured.err

    k, said = served_k()
    assert k == 2 and "K = 2: the fastest K measured for this draft" in said and str(out) in said
    k, said = served_k("--num-speculative-tokens", "1")  # told otherwise
    assert k == 1 and "K = 1: --num-speculative-tokens" in said
    (draft / "model.safetensors").write_bytes(b"retrained")  # another draft: its own K, and why
    k, said = served_k()
    assert k == 3 and "the draft's own" in said and "measured on another draft" in said


def test_serve_without_a_sweep_uses_the_drafts_own_k(capsys, pipeline_folders, tmp_path: Path):
    verifier, draft = pipeline_folders
    assert cli.main(["serve", "--verifier", str(verifier), "--draft", str(draft), "--print-command",
                     "--k-sweep", str(tmp_path / "absent.json")]) == 0
    captured = capsys.readouterr()
    assert '"num_speculative_tokens": 3' in captured.out and "K = 3: the draft's own; no " in captured.err


@pytest.mark.parametrize("content", ["not json", json.dumps({"serve_k": 2}), json.dumps({"serve_k": 0, "draft": {
    "sha256": "x"}})])
def test_a_broken_sweep_file_is_refused_in_one_line(capsys, pipeline_folders, tmp_path: Path, content):
    verifier, draft = pipeline_folders
    sweep = tmp_path / "k_sweep.json"
    sweep.write_text(content)
    assert cli.main(["serve", "--verifier", str(verifier), "--draft", str(draft), "--print-command",
                     "--k-sweep", str(sweep)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(sweep) in err and "k-sweep" in err


def test_bad_sweep_arguments_are_refused_before_an_engine_starts(capsys, tmp_path: Path):
    draft = _draft(tmp_path / "draft")
    assert cli.main(["k-sweep", "--draft", str(draft), "--repeats", "0"]) == 2
    assert "--repeats 0: must be at least 1" in capsys.readouterr().err
    assert cli.main(["k-sweep", "--draft", str(tmp_path / "none"), "--params", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "p.yaml" in err


@pytest.mark.slow
@requires_vllm
def test_the_real_sweep_on_the_tiny_pipeline(shared_pipeline: SharedPipeline, tmp_path: Path):
    out = tmp_path / "k_sweep.json"
    paths = PipelinePaths(shared_pipeline.repo / "params.yaml", shared_pipeline.repo / "models" / "verifier",
                          shared_pipeline.repo / "models" / "draft", shared_pipeline.repo / "data" / "prepared")
    done = subprocess.run(
        [sys.executable, "-m", "eaglenest", "k-sweep", "--ks", "1", "2", "--out", str(out), "--params",
         str(paths.params), "--verifier", str(paths.verifier), "--draft", str(paths.draft), "--prepared",
         str(paths.prepared)], cwd=tmp_path, env=project_env(), capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ks"] == [1, 2] and result["serve_k"] in (1, 2)
    assert result["draft"]["sha256"] == draft_fingerprint(paths.draft)
    (round_,) = result["rounds"]
    for k in ("1", "2"):
        for name, entry in round_["draft"][k].items():
            assert entry["steps_with_draft"] > 0 and 1.0 <= entry["tau_when_drafted"] <= int(k) + 1
            assert entry["speedup"] > 0 and entry["speedup_ci95"] >= 0 and len(entry["turns"]) == len(
                round_["plain"][k][name]["turns"])
    assert f"serve_k {result['serve_k']}" in done.stdout


def test_a_k_below_one_is_refused_before_anything_loads(capsys, tmp_path: Path):
    assert cli.main(["k-sweep", "--ks", "0", "2", "--params", str(tmp_path / "absent.yaml")]) == 2
    assert "--ks 0 2: every K must be at least 1" in capsys.readouterr().err
