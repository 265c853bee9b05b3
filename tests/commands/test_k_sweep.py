"""`eaglenest k-sweep`: the k_sweep stage's timing by hand, with other Ks or rounds than params.yaml's. The stage's
own tests (tests/stages/k_sweep/) cover the measurement; these, what the command adds."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from eaglenest.commands import cli
from tests.fixtures.fakes import FakeEngines


def test_the_command_times_the_ks_it_is_given_and_prints_what_it_found(
    tmp_path: Path, monkeypatch, capsys, pipeline_folders
):
    verifier, draft = pipeline_folders
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"k_sweep": {"ks": [1, 2]}}))
    rates = {"the verifier": 10.0} | {f"the eagle3 draft at K={k}": r for k, r in ((2, 12.0), (4, 15.0))}
    fake = FakeEngines(rates)
    fake.install(monkeypatch, ["general"])
    out = tmp_path / "k.json"
    assert (
        cli.main(
            [
                "k-sweep",
                "--ks",
                "2",
                "4",
                "--repeats",
                "2",
                "--params",
                str(params),
                "--verifier",
                str(verifier),
                "--draft",
                str(draft),
                "--prepared",
                str(tmp_path),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "general: draft K=2 x1.2, K=4 x1.5 (best K 4)"
    assert printed[1].startswith("serve_k 4: x1.5 ± 0.0 on general (the draft's own K is 3)")
    record = json.loads(out.read_text())
    assert record["ks"] == [2, 4] and record["repeats"] == 2 and len(fake.timed_together) == 2


def test_bad_sweep_arguments_are_refused_before_an_engine_starts(capsys, tmp_path: Path):
    assert cli.main(["k-sweep", "--repeats", "0"]) == 2
    assert "--repeats 0: must be at least 1" in capsys.readouterr().err
    assert cli.main(["k-sweep", "--ks", "0", "2"]) == 2
    assert "--ks 0 2: every K must be at least 1" in capsys.readouterr().err
    assert cli.main(["k-sweep", "--params", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "p.yaml" in err
