"""One writer per folder: an advisory lock that a second writer meets as one line instead of a race.

Two processes writing one folder (two ``dvc repro`` of one workspace, a stage run by hand beside DVC, two
``eaglenest remote start`` on one store) would interleave their files. Each writer holds ``flock`` on a lock file
in (or beside) the folder it writes for as long as it writes; a second writer is refused at once, told who holds the
lock. The kernel drops the lock when its holder exits, however it exits (``kill -9`` included), so a lock is never
left stale; the file itself stays, holding the last holder's name, and means nothing while nobody locks it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from eaglenest.core.errors import EaglenestError

LOCK_NAME = ".eaglenest.lock"


def lock_file_for(folder: Path) -> Path:
    """The lock file guarding ``folder``: beside it, so that removing or swapping the folder keeps the lock."""
    folder = Path(folder)
    return folder.with_name(f".{folder.name}{LOCK_NAME}")


@contextlib.contextmanager
def exclusive(lock_file: Path, what: str) -> Iterator[None]:
    """Holds an exclusive lock on ``lock_file`` (created 0600 where missing) for the block.

    Args:
        lock_file: The lock file (:func:`lock_file_for` names one for a folder).
        what: What the lock guards, for the refusal (``data/hidden_states``, ``the store in .eaglenest/store``).

    Raises:
        EaglenestError: another process holds the lock (naming its pid and host, as it recorded them).
    """
    lock_file = Path(lock_file)
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            raise EaglenestError(
                f"{what} is being written by {holder} (lock {lock_file}): wait for it to finish "
                "or stop it, then run again"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing drops the lock
