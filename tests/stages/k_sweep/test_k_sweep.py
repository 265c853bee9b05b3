"""The k_sweep stage: its params, the K it chooses from timed turns, the record, and the K serve and summary take
from it. Fast tests drive the stage with fake engines (the timing module's functions replaced); the real vLLM
sweep runs in the shared SmolLM2 pipeline's one `dvc repro`, checked by the slow test at the end."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

from eaglenest.artifacts.draft_hash import draft_fingerprint
from eaglenest.artifacts.k_record import read_k_record, served_k
from eaglenest.commands import cli
from eaglenest.commands.params_file import parse_params
from eaglenest.core.errors import ParamsError
from eaglenest.core.measure.beside_plain import add_speedup
from eaglenest.stages.k_sweep import KSweepPaths, sweep, sweep_ks
from eaglenest.stages.k_sweep.choice import best_ks, serve_k
from tests.conftest import requires_vllm
from tests.fixtures.fakes import FakeEngines
from tests.fixtures.pipeline import SharedPipeline


def test_params_problems_are_one_line_each():
    with pytest.raises(ParamsError) as err:
        parse_params({"k_sweep": {"ks": [0, 2], "timed_prompts": 0, "repeats": 0, "colour": "red"}})
    lines = str(err.value).splitlines()[1:]
    assert len(lines) == 4
    assert any("k_sweep.ks" in line and "every K must be at least 1" in line for line in lines)
    assert any(line.startswith("  - k_sweep.timed_prompts = 0:") for line in lines)
    assert any(line.startswith("  - k_sweep.repeats = 0:") for line in lines)
    assert any("k_sweep.colour: unknown key (allowed: ks, timed_prompts, repeats)" in line for line in lines)
    with pytest.raises(ParamsError, match="lists a K twice"):
        parse_params({"k_sweep": {"ks": [2, 2]}})
    defaults = parse_params({}).k_sweep
    assert (defaults.ks, defaults.repeats) == (None, 1)
    assert defaults.timed_prompts < parse_params({}).evaluate.timed_prompts  # the sweep chooses, evaluate measures


def test_the_ks_default_to_one_up_to_the_drafts_own():
    assert sweep_ks(None, 3) == [1, 2, 3] and sweep_ks([3, 1], 2) == [1, 3] and sweep_ks([2, 2], 3) == [2]


def _timed(spec: float, plain: float, turns: int = 4) -> dict:
    return {"turns": [[64, 64 / spec]] * turns, "plain_turns": [[64, 64 / plain]] * turns}


def _round(speedups: dict[str, dict[int, float]]) -> dict:
    """One round of the draft at each K, the plain engine at 10 tok/s beside it."""
    ks = list(next(iter(speedups.values())))
    return {
        "draft": {str(k): {n: {**_timed(10 * s[k], 10.0), "speedup": s[k]} for n, s in speedups.items()} for k in ks}
    }


def test_best_k_per_set_and_the_k_to_serve_over_pooled_turns():
    rounds = [
        _round({"code": {1: 1.1, 2: 1.5, 3: 1.2}, "chat": {1: 1.3, 2: 1.2, 3: 1.0}}),
        _round({"code": {1: 1.1, 2: 1.4, 3: 1.2}, "chat": {1: 1.3, 2: 1.25, 3: 1.0}}),
    ]
    best = best_ks(rounds, ["code", "chat"], [1, 2, 3], ["draft"])
    assert best["code"]["draft"]["k"] == 2 and best["code"]["draft"]["mean_speedup"] == pytest.approx(1.45)
    assert best["chat"]["draft"] == {
        "k": 1,
        "mean_speedup": 1.3,
        "mean_speedup_per_k": {"1": 1.3, "2": 1.225, "3": 1.0},
    }
    k, speedup, ci95, why = serve_k(rounds, ["code", "chat"], [1, 2, 3], 500, 0)
    # pooled over both sets and rounds: tokens over seconds of every turn, each set's turns equally long
    assert k == 2 and speedup == pytest.approx(1.33, abs=0.01) and ci95 > 0
    assert why.startswith("K 2 was fastest (x1.3") and "no smaller K's interval reaches it" in why


def test_a_tie_serves_the_smaller_k():
    assert serve_k([_round({"a": {1: 1.2, 2: 1.2}})], ["a"], [1, 2], 500, 0)[0] == 1


def test_a_faster_k_within_a_smaller_ones_interval_does_not_displace_it():
    # K 2 is faster on the pooled turns, by less than the turns' spread: K 1, the cheaper step, is served
    noisy = [_round({"a": {1: 1.1 + 0.2 * (i % 2), 2: 1.15 + 0.2 * (i % 2)}, "b": {1: 1.0, 2: 1.05}}) for i in range(4)]
    k, speedup, ci95, why = serve_k(noisy, ["a", "b"], [1, 2], 500, 0)
    assert k == 1 and why.startswith("K 2 was fastest") and "the smaller K, the cheaper step, stands" in why
    # far apart: the faster K stands
    clear = [_round({"a": {1: 1.0, 2: 1.6}, "b": {1: 1.0, 2: 1.6}}) for _ in range(4)]
    assert serve_k(clear, ["a", "b"], [1, 2], 500, 0)[0] == 2


def test_speed_up_interval_over_paired_turns():
    steady = _timed(20.0, 10.0, turns=6)
    add_speedup(steady, 500, 0)
    assert steady["speedup"] == 2.0 and steady["speedup_ci95"] == 0.0  # every turn x2: no spread
    uneven = {"turns": [[64, s] for s in (2.0, 6.0, 3.0, 5.0, 4.0, 5.6)], "plain_turns": [[64, 6.4]] * 6}
    add_speedup(uneven, 500, 0)
    assert 0.05 < uneven["speedup_ci95"] < 1.0


def _params(**k_sweep) -> object:
    return parse_params({"k_sweep": k_sweep})


def test_the_stage_records_the_fastest_k_and_serve_and_summary_use_it(
    tmp_path: Path, monkeypatch, capsys, pipeline_folders
):
    verifier, draft = pipeline_folders
    # the draft is fastest at K=2; the plain engine decodes at 10 tok/s
    rates = {"the verifier": 10.0} | {f"the eagle3 draft at K={k}": r for k, r in ((1, 12.0), (2, 15.0), (3, 13.0))}
    fake = FakeEngines(rates)
    fake.install(monkeypatch, ["humaneval", "general"])
    out = tmp_path / "metrics" / "k_sweep.json"
    record = sweep(_params(ks=[1, 2, 3], repeats=2), KSweepPaths(verifier, tmp_path, draft, out))
    # the plain engine starts once and is timed beside every group of two; a group's engines close after it
    assert fake.started == [
        "the verifier",
        "the eagle3 draft at K=1",
        "the eagle3 draft at K=2",
        "the eagle3 draft at K=3",
    ]
    assert fake.timed_together == [["plain", "draft K=1", "draft K=2"]] * 4 + [["plain", "draft K=3"]] * 4
    assert fake.closed[-1] == "the verifier"
    assert json.loads(out.read_text()) == record
    assert record["serve_k"] == 2 and record["serve"] == {
        "k": 2,
        "speedup": 1.5,
        "speedup_ci95": 0.0,
        "sets": ["humaneval", "general"],
    }
    assert record["draft"]["sha256"] == draft_fingerprint(draft) and record["draft"]["trained_k"] == 3
    entry = record["rounds"][1]["draft"]["3"]["general"]
    assert entry["speedup"] == 1.3 and entry["tau_when_drafted"] == 2.0 and len(entry["plain_turns"]) == 3
    assert record["best"]["humaneval"]["draft"]["mean_speedup_per_k"] == {"1": 1.2, "2": 1.5, "3": 1.3}

    def serve_says(*extra: str) -> tuple[int, str]:
        assert (
            cli.main(
                [
                    "serve",
                    "--verifier",
                    str(verifier),
                    "--draft",
                    str(draft),
                    "--print-command",
                    "--k-sweep",
                    str(out),
                    *extra,
                ]
            )
            == 0
        )
        captured = capsys.readouterr()
        argv = shlex.split(captured.out.strip())
        return json.loads(argv[argv.index("--speculative-config") + 1])["num_speculative_tokens"], captured.err

    k, said = serve_says()
    assert (
        k == 2
        and ("served K: 2 (measured for this draft by the k_sweep stage: x1.50 ± 0.00 on humaneval, general)") in said
    )
    k, said = serve_says("--num-speculative-tokens", "1")  # told otherwise
    assert k == 1 and "served K: 1 (--num-speculative-tokens)" in said
    assert served_k(draft, record_file=out).line() in _summary(tmp_path, capsys)

    (draft / "model.safetensors").write_bytes(b"retrained")  # another draft: its own K, and why
    k, said = serve_says()
    assert k == 3 and f"served K: 3 (the draft's own: {out} was measured on another draft; `dvc repro k_sweep`" in said
    assert "measured on another draft" in _summary(tmp_path, capsys)


def _summary(repo: Path, capsys) -> str:
    (repo / "metrics" / "eval.json").write_text(json.dumps({"lossless": 1.0}))
    (repo / "metrics" / "train.json").write_text(json.dumps({}))
    assert cli.main(["summary", "--repo", str(repo)]) == 0
    return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("served K: "))


def test_n_gram_is_no_longer_the_sweeps_and_its_old_switch_says_where_it_went():
    with pytest.raises(
        ParamsError,
        match=r"k_sweep.ngram: n-gram drafting is timed at each window and K by the "
        r"free_sweep stage",
    ):
        parse_params({"k_sweep": {"ngram": True}})


def test_without_vllm_in_evaluate_no_k_is_measured_and_serve_says_why(tmp_path: Path, capsys, pipeline_folders):
    verifier, draft = pipeline_folders
    out = tmp_path / "k_sweep.json"
    sweep(parse_params({"evaluate": {"backend": "hf"}}), KSweepPaths(verifier, tmp_path, draft, out))
    record = read_k_record(out)
    assert record.served is None and "evaluate.backend lists no vllm" in record.not_measured
    assert (
        cli.main(
            ["serve", "--verifier", str(verifier), "--draft", str(draft), "--print-command", "--k-sweep", str(out)]
        )
        == 0
    )
    said = capsys.readouterr().err
    assert f"served K: 3 (the draft's own: {out} measured no K (evaluate.backend lists no vllm" in said


def test_serve_without_a_record_uses_the_drafts_own_k(capsys, pipeline_folders, tmp_path: Path):
    verifier, draft = pipeline_folders
    assert (
        cli.main(
            [
                "serve",
                "--verifier",
                str(verifier),
                "--draft",
                str(draft),
                "--print-command",
                "--k-sweep",
                str(tmp_path / "absent.json"),
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert '"num_speculative_tokens": 3' in captured.out
    assert "served K: 3 (the draft's own: no " in captured.err and "`dvc repro k_sweep` measures it" in captured.err


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        json.dumps({"serve_k": 2}),
        json.dumps({"draft": {"sha256": "x"}, "serve": {"k": 0, "speedup": 1.0, "speedup_ci95": 0.0, "sets": []}}),
    ],
)
def test_a_broken_record_is_refused_in_one_line(capsys, pipeline_folders, tmp_path: Path, content):
    verifier, draft = pipeline_folders
    record = tmp_path / "k_sweep.json"
    record.write_text(content)
    assert (
        cli.main(
            ["serve", "--verifier", str(verifier), "--draft", str(draft), "--print-command", "--k-sweep", str(record)]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(record) in err and "k_sweep" in err


@pytest.mark.slow
@requires_vllm
def test_the_real_sweep_in_the_shared_pipeline(shared_pipeline: SharedPipeline):
    """The shared pipeline's `dvc repro` ran the stage with vLLM's CPU build (SHARED_PARAMS' k_sweep: two Ks, one
    turn per set): every K timed on every headline set beside the plain engine, and serve takes its K."""
    repo = shared_pipeline.repo
    assert "Running stage 'k_sweep'" in shared_pipeline.first_repro
    params = yaml.safe_load((repo / "params.yaml").read_text())
    record = json.loads((repo / "metrics" / "k_sweep.json").read_text())
    headline = [s["name"] for s in params["evaluate"]["sets"] if s.get("headline")]
    assert record["ks"] == params["k_sweep"]["ks"] and record["serve_k"] in record["ks"]
    assert record["draft"]["sha256"] == draft_fingerprint(repo / "models" / "draft")
    assert record["serve"]["sets"] == headline and record["serve"]["speedup"] > 0
    (round_,) = record["rounds"]
    for k in map(str, record["ks"]):
        assert list(round_["draft"][k]) == headline
        for entry in round_["draft"][k].values():
            assert entry["steps_with_draft"] > 0 and 1.0 <= entry["tau_when_drafted"] <= int(k) + 1
            assert entry["speedup"] > 0 and entry["speedup_ci95"] >= 0
            assert len(entry["turns"]) == len(entry["plain_turns"]) == params["k_sweep"]["timed_prompts"]
    assert set(record["seconds"]["start"]) == {"plain", *(f"draft K={k}" for k in record["ks"])}
    assert served_k(repo / "models" / "draft", record_file=repo / "metrics" / "k_sweep.json").k == record["serve_k"]


def test_an_interrupted_sweep_writes_nothing_and_stops_every_engine(tmp_path: Path, monkeypatch, pipeline_folders):
    verifier, draft = pipeline_folders
    rates = {"the verifier": 10.0} | {f"the eagle3 draft at K={k}": 12.0 for k in (1, 2, 3)}
    fake = FakeEngines(rates)
    fake.install(monkeypatch, ["general"])
    timed = fake.time_interleaved

    def interrupted_in_the_second_group(engines, *args):
        if "draft K=3" in engines:
            raise KeyboardInterrupt  # Ctrl-C, or SIGTERM (core/stage.py turns it into this)
        return timed(engines, *args)

    monkeypatch.setattr("eaglenest.core.measure.single_stream.time_interleaved", interrupted_in_the_second_group)
    out = tmp_path / "k_sweep.json"
    out.write_text("an earlier record")
    with pytest.raises(KeyboardInterrupt):
        sweep(_params(ks=[1, 2, 3]), KSweepPaths(verifier, tmp_path, draft, out))
    assert sorted(fake.closed) == sorted(fake.started)  # the plain engine and both groups' engines
    assert out.read_text() == "an earlier record"  # the record is written whole at the end, or not at all
