"""A supervised server's whole process tree ends with its parent: on SIGKILL of the parent (the watchdog and the
parent-death signal), on a signal passed on, and on the command's own exit. A stand-in server of two processes (a
leader and its "engine" child, as vLLM's API server and engine core) keeps these tests at a second or two."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.pipeline import project_env

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads the process tree from /proc")

# A leader that starts an engine child in its own process group, writes both pids, and waits for it.
FAKE_SERVER = (
    "import subprocess, sys, time\n"
    "engine = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "open(sys.argv[1], 'w').write(f'{engine.pid}')\n"
    "sys.exit(engine.wait() and 3)\n"
)
SUPERVISOR = (
    "import os, sys; from eaglenest.commands.supervised import run_in_foreground; "
    "raise SystemExit(run_in_foreground(sys.argv[1:], dict(os.environ)))"
)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting for its parent to reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def descendants(pid: int) -> set[int]:
    """Every process below ``pid``, from the parent pids in /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def start_supervised(tmp_path: Path) -> tuple[subprocess.Popen, int]:
    """The supervisor running the stand-in server; returns it and the engine child's pid once it runs."""
    pid_file = tmp_path / "engine.pid"
    supervisor = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, sys.executable, "-c", FAKE_SERVER, str(pid_file)], env=project_env()
    )
    assert wait_for(lambda: pid_file.is_file() and pid_file.read_text().strip() != ""), "the server never started"
    return supervisor, int(pid_file.read_text())


def test_sigkill_of_the_parent_leaves_no_process_of_the_server(tmp_path: Path):
    supervisor, engine = start_supervised(tmp_path)
    tree = descendants(supervisor.pid)
    assert engine in tree and len(tree) >= 3  # the watchdog, the leader, its engine
    supervisor.kill()
    supervisor.wait()
    assert wait_for(lambda: not any(alive(pid) for pid in tree), timeout_s=5), [pid for pid in tree if alive(pid)]


def test_a_signal_to_the_parent_reaches_the_server_and_its_status_is_the_parents(tmp_path: Path):
    supervisor, engine = start_supervised(tmp_path)
    tree = descendants(supervisor.pid)
    supervisor.send_signal(signal.SIGTERM)
    # the leader got SIGTERM (128 + 15); its engine, which ignores nothing, went with the group
    assert supervisor.wait(timeout=30) == 128 + signal.SIGTERM
    assert not any(alive(pid) for pid in tree)


def test_the_servers_exit_status_is_returned_and_its_leftovers_stopped(tmp_path: Path):
    supervisor, engine = start_supervised(tmp_path)
    tree = descendants(supervisor.pid)
    os.kill(engine, signal.SIGKILL)  # the engine dies: the leader exits with 3
    assert supervisor.wait(timeout=30) == 3
    assert not any(alive(pid) for pid in tree)
