"""The one-writer lock: a second holder refused with one line, the lock gone with its holder however it exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from eaglenest.core.errors import EaglenestError
from eaglenest.core.lock import exclusive, lock_file_for


def test_a_second_writer_is_refused_naming_the_first(tmp_path: Path) -> None:
    lock = lock_file_for(tmp_path / "out")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom eaglenest.core.lock import exclusive\n"
            f"with exclusive({str(lock)!r}, 'out'):\n    print('held', flush=True)\n"
            "    time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with (
            pytest.raises(EaglenestError, match=rf"out is being written by pid {holder.pid} on .*: wait"),
            exclusive(lock, "out"),
        ):
            pass
        os.kill(holder.pid, signal.SIGKILL)  # the kernel drops a killed holder's lock
        holder.wait()
        with exclusive(lock, "out"):
            assert oct(lock.stat().st_mode & 0o777) == "0o600"
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_is_released_after_an_error_in_the_block(tmp_path: Path) -> None:
    lock = tmp_path / "x.lock"
    with pytest.raises(RuntimeError), exclusive(lock, "x"):
        raise RuntimeError
    with exclusive(lock, "x"):
        pass
