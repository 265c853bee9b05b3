"""``eaglenest export`` never deletes its own inputs, nor a folder of the user's it did not write."""

from __future__ import annotations

from pathlib import Path

import pytest

from eaglenest.commands.cli import main as cli_main
from tests.commands.test_importer import _snapshot


@pytest.mark.parametrize(
    ("out", "flag", "overlap"),
    [
        ("data/prepared", "--prepared", "is the same folder as"),
        ("data", "--prepared", "contains"),
        ("data/hidden_states/export", "--hidden-states", "lies inside"),
    ],
)
def test_an_out_that_overlaps_an_input_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture, out: str, flag: str, overlap: str
) -> None:
    prepared, hidden_states = tmp_path / "data" / "prepared", tmp_path / "data" / "hidden_states"
    prepared.mkdir(parents=True)
    (prepared / "dataset_info.json").write_text("{}")
    hidden_states.mkdir()
    (hidden_states / "shard_0.safetensors").write_bytes(b"rows")
    before = _snapshot(tmp_path)
    status = cli_main(
        [
            "export",
            "--format",
            "speculators",
            "--prepared",
            str(prepared),
            "--hidden-states",
            str(hidden_states),
            "--out",
            str(tmp_path / out),
        ]
    )
    err = capsys.readouterr().err
    source = prepared if flag == "--prepared" else hidden_states
    assert status != 0 and len(err.strip().splitlines()) == 1
    assert f"--out {tmp_path / out} {overlap} {flag} {source}: writing it would delete" in err
    assert _snapshot(tmp_path) == before


def test_a_folder_export_did_not_write_is_kept_without_force(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    status = cli_main(
        [
            "export",
            "--format",
            "speculators",
            "--prepared",
            str(tmp_path / "p"),
            "--hidden-states",
            str(tmp_path / "h"),
            "--out",
            str(mine),
        ]
    )
    err = capsys.readouterr().err
    assert status != 0 and f"--out {mine} exists and was not written by eaglenest export" in err
    assert (mine / "notes.txt").read_text() == "keep me"
