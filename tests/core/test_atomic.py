"""Atomic writes: temporaries no two writers share and that are never written through a planted link, names made
durable, and a folder swap that a kill at any moment leaves with a folder under its name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import eaglenest.core.atomic as atomic
from eaglenest.core.atomic import (
    ASIDE_MARKER,
    TMP_MARKER,
    atomic_directory,
    atomic_write_bytes,
    open_exclusive,
    remove_stale_temps,
    temp_sibling,
)
from eaglenest.core.errors import EaglenestError


def test_two_temporaries_for_one_file_differ_and_name_the_host(tmp_path: Path) -> None:
    final = tmp_path / "out.bin"
    first, second = temp_sibling(final), temp_sibling(final)
    assert first != second and first.parent == second.parent == tmp_path
    assert first.name.startswith(f".out.bin{TMP_MARKER}") and f"-{os.getpid()}-" in first.name


@pytest.mark.parametrize("planted", ["symlink", "file"])
def test_a_name_planted_where_a_temporary_goes_is_never_written_through(tmp_path: Path, planted: str) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    name = tmp_path / ".out.bin.tmp-planted"
    if planted == "symlink":
        name.symlink_to(victim)
    else:
        name.write_bytes(b"precious")
    with pytest.raises(FileExistsError):
        open_exclusive(name)
    assert victim.read_bytes() == b"precious" and name.read_bytes() == b"precious"


def test_atomic_open_refuses_a_planted_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    planted = tmp_path / ".out.bin.tmp-planted"
    planted.symlink_to(victim)
    monkeypatch.setattr(atomic, "temp_sibling", lambda final: planted)  # the attacker guessed the name
    with pytest.raises(EaglenestError, match=r"could not write .*out.bin: File exists"):
        atomic_write_bytes(tmp_path / "out.bin", b"data")
    assert victim.read_bytes() == b"precious" and not (tmp_path / "out.bin").exists()


def test_stale_temporaries_are_found_by_their_final_name(tmp_path: Path) -> None:
    kept, removed = temp_sibling(tmp_path / "theirs.bin"), temp_sibling(tmp_path / "mine.tmp-1.bin")
    kept.write_bytes(b"")
    removed.mkdir()
    (tmp_path / "mine.tmp-1.bin").write_bytes(b"final")
    assert remove_stale_temps(tmp_path, mine=lambda name: name == "mine.tmp-1.bin") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([kept.name, "mine.tmp-1.bin"])


def _fsynced_paths(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records the path of every descriptor fsync'd (the real fsync still runs)."""
    paths: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        paths.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    return paths


def test_a_written_file_and_then_its_folder_are_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = _fsynced_paths(monkeypatch)
    atomic_write_bytes(tmp_path / "out.bin", b"data")
    assert TMP_MARKER in Path(paths[0]).name and paths[1:] == [str(tmp_path)]


def test_a_folder_its_files_and_then_its_parent_are_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = _fsynced_paths(monkeypatch)
    with atomic_directory(tmp_path / "out") as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "a.bin").write_bytes(b"a")  # a plain write, as copytree and save_to_disk do
    names = [Path(path).name for path in paths]
    assert names.index("a.bin") < names.index("sub") and paths[-1] == str(tmp_path)


def test_replacing_a_folder_leaves_only_the_new_folder(tmp_path: Path) -> None:
    final = tmp_path / "out"
    for content in (b"old", b"new"):
        with atomic_directory(final) as tmp:
            (tmp / "f").write_bytes(content)
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (final / "f").read_bytes() == b"new"


# Kills itself at a rename of the swap: "between" before the new folder's rename (the old one already aside in the
# fixed code, already deleted in a swap that deletes first), "after" right after it.
_KILLED_SWAP = """
import os, signal, sys
from pathlib import Path
import eaglenest.core.atomic as atomic
final, moment = Path(sys.argv[1]), sys.argv[2]
real_replace = os.replace
def replace(src, dst):
    if Path(dst) == final and moment == "between":
        os.kill(os.getpid(), signal.SIGKILL)
    real_replace(src, dst)
    if Path(dst) == final and moment == "after":
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace
with atomic.atomic_directory(final) as tmp:
    (tmp / "f").write_bytes(b"new")
"""


@pytest.mark.parametrize("moment", ["between", "after"])
def test_a_kill_during_a_folder_swap_never_loses_the_folder(tmp_path: Path, moment: str) -> None:
    final = tmp_path / "out"
    final.mkdir()
    (final / "f").write_bytes(b"old")
    killed = subprocess.run([sys.executable, "-c", _KILLED_SWAP, str(final), moment], check=False)
    assert killed.returncode == -signal.SIGKILL
    expected = b"old" if moment == "between" else b"new"
    with pytest.raises(RuntimeError), atomic_directory(final):
        raise RuntimeError  # a rerun that fails still finds the folder back under its name
    assert (final / "f").read_bytes() == expected
    assert not [p for p in tmp_path.iterdir() if ASIDE_MARKER in p.name]
    assert remove_stale_temps(tmp_path) == (1 if moment == "between" else 0)  # the killed run's temporary
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_stale_temps_cleanup_puts_an_aside_folder_back(tmp_path: Path) -> None:
    aside = tmp_path / f".out{ASIDE_MARKER}host-1-ab"
    aside.mkdir()
    (aside / "f").write_bytes(b"old")
    temp_sibling(tmp_path / "x.old-1").write_bytes(b"")  # a temporary whose final name holds the aside marker
    assert remove_stale_temps(tmp_path) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (tmp_path / "out" / "f").read_bytes() == b"old"
