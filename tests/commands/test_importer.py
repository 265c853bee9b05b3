"""``eaglenest import`` never deletes its own input, nor a folder of the user's it did not write."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eaglenest.commands.cli import main as cli_main


def _write_dump(folder: Path) -> None:
    """Two speculators-pt samples that import takes: an import that went ahead would replace whatever --out is."""
    folder.mkdir()
    for sample in range(2):
        torch.save(
            {
                "input_ids": torch.arange(4) + 3,
                "hidden_states": [torch.randn(4, 8) for _ in range(2)],
                "loss_mask": torch.tensor([0, 1, 1, 1]),
            },
            folder / f"data_{sample}.pt",
        )


def _import(source: Path, out: Path, *flags: str) -> int:
    return cli_main(["import", "--format", "speculators-pt", str(source), "--out", str(out), *flags])


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


@pytest.mark.parametrize(
    ("out", "overlap"),
    [
        ("dump", "is the same folder as"),
        ("link", "is the same folder as"),
        (".", "contains"),
        ("dump/out", "lies inside"),
    ],
)
def test_an_out_that_overlaps_the_source_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture, out: str, overlap: str
) -> None:
    source = tmp_path / "dump"
    _write_dump(source)
    (tmp_path / "link").symlink_to(source)
    before = _snapshot(tmp_path)
    status = _import(source, tmp_path / out)
    err = capsys.readouterr().err
    assert status != 0 and len(err.strip().splitlines()) == 1
    assert f"--out {tmp_path / out} {overlap} the source {source}: writing it would delete" in err
    assert "pick another --out" in err
    assert _snapshot(tmp_path) == before


def test_a_folder_import_did_not_write_is_kept_without_force(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _write_dump(tmp_path / "dump")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    status = _import(tmp_path / "dump", mine)
    err = capsys.readouterr().err
    assert status != 0 and f"--out {mine} exists and was not written by eaglenest import" in err
    assert "pass --force to replace it" in err and (mine / "notes.txt").read_text() == "keep me"


def test_import_replaces_its_own_output_and_with_force_a_folder_of_the_users(tmp_path: Path) -> None:
    _write_dump(tmp_path / "dump")
    out = tmp_path / "imported"
    assert _import(tmp_path / "dump", out) == 0 and _import(tmp_path / "dump", out) == 0  # a rerun
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("replace me")
    assert _import(tmp_path / "dump", tmp_path / "mine", "--force") == 0
    assert _snapshot(tmp_path / "mine") == _snapshot(out)
