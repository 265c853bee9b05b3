"""Atomic writes: every output appears under its final name complete, or not at all.

A stage killed mid-write leaves at worst a hidden ``.<name>.tmp-<host>-<pid>-<random>`` sibling, which the next
run removes; it never leaves a half-written file under a name that a rerun (or DVC) would trust. The host and the
random part keep two writers apart even on a folder that several machines share (NFS, a cluster's storage), and
temporaries are created exclusively, so a file or symlink planted at a temporary's name is never written through.
A folder being replaced is first renamed aside (``.<name>.old-...``), so a kill between the two renames leaves the
old folder, which the next write of that folder puts back.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from eaglenest.core.errors import EaglenestError

TMP_MARKER = ".tmp-"
ASIDE_MARKER = ".old-"
# In a folder that a command writes whole (import, export): which command wrote it, so that a rerun replaces it
# without asking and a folder of the user's is never replaced unless they pass --force.
WRITTEN_BY_FILE = ".eaglenest-output"

# What a hidden sibling's name holds after its marker (host-pid-random): no '.', so that no marker can follow it.
_SUFFIX_CHARS = "A-Za-z0-9-"
_SUFFIX = re.compile(f"[{_SUFFIX_CHARS}]+")
# O_EXCL refuses a name that exists (a symlink included); O_NOFOLLOW is the belt to its braces.
_EXCLUSIVE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _hidden_sibling(final: Path, marker: str) -> Path:
    # The host keeps only the suffix's characters, so that final_name_of() finds the final name after the last
    # marker, whatever the final name holds.
    host = re.sub(f"[^{_SUFFIX_CHARS}]", "-", socket.gethostname()) or "host"
    return final.with_name(f".{final.name}{marker}{host}-{os.getpid()}-{secrets.token_hex(6)}")


def temp_sibling(final: Path) -> Path:
    """A fresh temporary name for writing ``final`` (same directory, same filesystem): two calls never agree."""
    return _hidden_sibling(Path(final), TMP_MARKER)


def final_name_of(name: str, marker: str = TMP_MARKER) -> str | None:
    """The final name a hidden sibling (temporary or aside) named ``name`` stands for; None if it is none."""
    final, found, suffix = name[1:].rpartition(marker)
    # What follows the marker is host-pid-random (or a pid, from before): a '.' there means the marker was part of
    # the final name, as in the temporary of a file named ``x.old-1``, which is no aside of ``x``.
    if not name.startswith(".") or not found or not final or not _SUFFIX.fullmatch(suffix):
        return None
    return final


def open_exclusive(path: Path, mode: int = 0o666) -> int:
    """Creates ``path`` for writing and returns its descriptor; refuses (FileExistsError) a name that exists,
    a symlink included, instead of writing through it."""
    return os.open(path, _EXCLUSIVE_FLAGS, mode)


def fsync_directory(directory: Path) -> None:
    """Makes the names in ``directory`` (a rename into it) durable, not only the files' contents."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _settle_asides(directory: Path, mine: Callable[[str], bool] | None) -> int:
    """Finishes folder swaps that a kill interrupted: an aside whose folder is missing goes back under its name
    (the old folder is never lost); one whose folder is in place is removed. Returns how many were handled."""
    asides: dict[str, list[Path]] = {}
    for entry in directory.iterdir():
        name = final_name_of(entry.name, ASIDE_MARKER)
        if name is not None and (mine is None or mine(name)):
            asides.setdefault(name, []).append(entry)
    handled = sum(len(entries) for entries in asides.values())
    for name, entries in asides.items():
        final = directory / name
        if not (final.exists() or final.is_symlink()):
            newest = max(entries, key=lambda entry: entry.lstat().st_mtime)
            os.replace(newest, final)
            entries.remove(newest)
        for entry in entries:
            _remove(entry)
    if asides:
        fsync_directory(directory)
    return handled


def remove_stale_temps(directory: Path, mine: Callable[[str], bool] | None = None) -> int:
    """Deletes temporaries left by killed writers in ``directory`` and finishes their folder swaps; returns how
    many temporaries and asides it handled.

    Args:
        directory: The folder.
        mine: Given the final name a temporary was written for, whether this process owns it; None owns
            all. Writers sharing a folder (extract parts on several nodes) must not delete each other's
            temporaries while they are being written.
    """
    if not directory.is_dir():
        return 0
    removed = _settle_asides(directory, mine)
    for entry in directory.iterdir():
        name = final_name_of(entry.name)
        if name is None or (mine is not None and not mine(name)):
            continue
        _remove(entry)
        removed += 1
    return removed


def _fail(final: Path, err: OSError) -> EaglenestError:
    return EaglenestError(f"could not write {final}: {err.strerror or err} (nothing was left under that name)")


def atomic_write_bytes(final: Path, data: bytes, fsync: bool = True, mode: int = 0o666) -> None:
    """Writes ``data`` to ``final`` through a temporary file and a rename (fsync'd first by default); ``mode`` as
    :func:`atomic_open`'s."""
    with atomic_open(final, fsync=fsync, mode=mode) as fh:
        fh.write(data)


@contextlib.contextmanager
def atomic_open(final: Path, fsync: bool = True, mode: int = 0o666) -> Iterator[BinaryIO]:
    """A binary file to stream into that replaces ``final`` (rename) only if the block succeeds; on any exception
    the temporary is deleted and ``final`` is left as it was.

    Args:
        final: The file to write.
        fsync: Whether the file and then its folder (the rename) are made durable before returning.
        mode: The permission bits the temporary is created with (less the umask), so that a secret (0600) is never
            readable by others, not even before the rename.
    """
    final = Path(final)
    tmp = temp_sibling(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        fd = open_exclusive(tmp, mode)
    except OSError as err:
        raise _fail(final, err) from err
    try:
        fh = open(fd, "wb")  # noqa: SIM115 (closed below, before the rename)
    except BaseException as err:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise _fail(final, err) from err
        raise
    try:
        with fh:
            yield fh
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, final)
        if fsync:
            fsync_directory(final.parent)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise _fail(final, err) from err
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_json(final: Path, obj: Any, mode: int = 0o666) -> None:
    """Writes ``obj`` as indented JSON (with a trailing newline) atomically; ``mode`` as :func:`atomic_open`'s."""
    atomic_write_bytes(Path(final), (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode(), mode=mode)


def _fsync_tree(root: Path) -> None:
    """Makes every file and folder under ``root`` durable: the callers of atomic_directory write its files with
    plain writes (copytree, save_to_disk, safetensors), so nothing else has."""
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if os.path.islink(path):
                continue
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_directory(Path(folder))


def _swap_in(tmp: Path, final: Path) -> None:
    """Puts ``tmp`` under ``final``'s name: the old ``final`` is renamed aside first and removed only once the new
    one is in place, so a kill at any moment leaves one of them (a rerun settles the aside)."""
    aside = None
    if final.exists() or final.is_symlink():
        aside = _hidden_sibling(final, ASIDE_MARKER)
        os.replace(final, aside)
    try:
        os.replace(tmp, final)
    except OSError:
        if aside is not None:
            os.replace(aside, final)
        raise
    fsync_directory(final.parent)
    if aside is not None:
        _remove(aside)


@contextlib.contextmanager
def atomic_directory(final: Path, fsync: bool = True) -> Iterator[Path]:
    """Yields a temporary directory that replaces ``final`` only if the block succeeds.

    On any exception the temporary directory is deleted and ``final`` is left as it was. A swap that a kill
    interrupted earlier is finished first (see :func:`remove_stale_temps`).

    Args:
        final: The folder to write.
        fsync: Whether the folder's files, and the rename, are made durable before returning.
    """
    final = Path(final)
    tmp = temp_sibling(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        _settle_asides(final.parent, lambda name: name == final.name)
        tmp.mkdir()  # a fresh random name: mkdir is exclusive, never through a planted link
    except OSError as err:
        raise _fail(final, err) from err
    try:
        yield tmp
        if fsync:
            _fsync_tree(tmp)
        _swap_in(tmp, final)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _fail(final, err) from err
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def mark_written_by(folder: Path, command: str) -> None:
    """Records in ``folder`` (being written by :func:`atomic_directory`) that ``command`` wrote it."""
    (folder / WRITTEN_BY_FILE).write_text(command + "\n")


def _written_by(folder: Path) -> str | None:
    try:
        return (folder / WRITTEN_BY_FILE).read_text().strip()
    except OSError:
        return None


def _overlap(out: Path, source: Path) -> str | None:
    """How the folder ``out`` overlaps ``source`` (symlinks resolved), in words; None where they are apart."""
    out, source = out.resolve(), source.resolve()
    if out == source:
        return "is the same folder as"
    if source.is_relative_to(out):
        return "contains"
    if out.is_relative_to(source):
        return "lies inside"
    return None


def check_replaceable(out: Path, inputs: dict[str, Path], command: str, force: bool) -> None:
    """Refuses, before anything is touched, an output folder whose replacement would delete data: one that is, holds
    or lies in one of the command's inputs, or (without ``force``) one that ``command`` did not write.

    Args:
        out: The ``--out`` folder, which :func:`atomic_directory` would replace whole.
        inputs: Each input's flag (``--prepared``) and path.
        command: The command writing ``out`` (``eaglenest export``), as :func:`mark_written_by` records it.
        force: The user asked to replace ``out`` whatever it holds.

    Raises:
        EaglenestError: one line naming both paths, or ``out`` and ``--force``.
    """
    for flag, source in inputs.items():
        overlap = _overlap(out, source)
        if overlap is not None:
            raise EaglenestError(
                f"--out {out} {overlap} {flag} {source}: writing it would delete {command}'s input; pick another --out"
            )
    if force or not (out.exists() or out.is_symlink()):
        return
    if out.is_dir() and not out.is_symlink() and (not any(out.iterdir()) or _written_by(out) == command):
        return
    raise EaglenestError(
        f"--out {out} exists and was not written by {command} (no {WRITTEN_BY_FILE} naming it): "
        "pick another --out, or pass --force to replace it"
    )
