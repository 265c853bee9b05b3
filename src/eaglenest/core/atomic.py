"""Atomic writes: every output appears under its final name complete, or not at all.

A stage killed mid-write leaves at worst a hidden ``.<name>.tmp-<pid>`` sibling, which the next run
removes; it never leaves a half-written file under a name that a rerun (or DVC) would trust.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from eaglenest.core.errors import EaglenestError

TMP_MARKER = ".tmp-"


def temp_sibling(final: Path) -> Path:
    """The temporary name used while ``final`` is being written (same directory, same filesystem)."""
    return final.with_name(f".{final.name}{TMP_MARKER}{os.getpid()}")


def remove_stale_temps(directory: Path, mine: Callable[[str], bool] | None = None) -> int:
    """Deletes temporaries left by killed writers in ``directory``; returns how many.

    Args:
        directory: The folder.
        mine: Given the final name a temporary was written for, whether this process owns it; None owns
            all. Writers sharing a folder (extract parts on several nodes) must not delete each other's
            temporaries while they are being written.
    """
    removed = 0
    if not directory.is_dir():
        return 0
    for entry in directory.iterdir():
        if entry.name.startswith(".") and TMP_MARKER in entry.name:
            if mine is not None and not mine(entry.name[1:].split(TMP_MARKER)[0]):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
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

    ``mode`` is the temporary's mode from its creation (less the umask), so that a secret (0600) is never readable
    by others, not even before the rename.
    """
    final = Path(final)
    tmp = temp_sibling(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        fh = open(tmp, "wb", opener=lambda path, flags: os.open(path, flags, mode))  # noqa: SIM115 (closed below)
    except OSError as err:
        raise _fail(final, err) from err
    try:
        with fh:
            yield fh
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, final)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise _fail(final, err) from err
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_json(final: Path, obj: Any, mode: int = 0o666) -> None:
    """Writes ``obj`` as indented JSON (with a trailing newline) atomically; ``mode`` as :func:`atomic_open`'s."""
    atomic_write_bytes(Path(final), (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode(), mode=mode)


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yields a temporary directory that replaces ``final`` only if the block succeeds.

    On any exception the temporary directory is deleted and ``final`` is left as it was.
    """
    final = Path(final)
    tmp = temp_sibling(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as err:
        raise _fail(final, err) from err
    try:
        yield tmp
        if final.exists() or final.is_symlink():
            if final.is_dir() and not final.is_symlink():
                shutil.rmtree(final)
            else:
                final.unlink()
        os.replace(tmp, final)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _fail(final, err) from err
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
