"""A server started as a child whose whole process tree ends with its parent, however the parent ends.

vLLM's OpenAI server starts its engine core as a child process, which starts its workers; an ``exec`` of the server
(or a plain child) leaves the engine running, holding the cores, memory and the port, when whatever started it is
killed with SIGKILL. So the server runs here as a child in a process group of its own, and three things end that
group:

* the parent's own way out (:meth:`SupervisedGroup.stop`): SIGTERM to the group, SIGKILL after a grace period, then
  waiting until no process of the group is left;
* a watchdog, a small Python process in a session of its own that holds the read end of a pipe whose write end only
  the parent holds: when the parent ends in any way, SIGKILL included, the pipe closes and the watchdog sends
  SIGKILL to the server's group (unless the parent said, by writing ``done``, that it stopped the group itself);
* on Linux, the server's own parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)`` before it runs), in case the
  watchdog itself was killed with the parent's process group.

A process that leaves the group (``setsid``) escapes all three; vLLM's engine and workers stay in it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import IO, Any

# prctl(2)'s option number for the parent-death signal (linux/prctl.h).
PR_SET_PDEATHSIG = 1
# After SIGTERM, how long the server (and its engine processes) may take to go before SIGKILL.
STOP_GRACE_S = 30.0
GROUP_POLL_S = 0.1
# The watchdog: reads the pipe until it closes; b"done" means the parent stopped the group itself.
WATCHDOG = (
    "import os, signal, sys\n"
    "group = int(sys.argv[1])\n"
    "if sys.stdin.buffer.read() != b'done':\n"
    "    try:\n"
    "        os.killpg(group, signal.SIGKILL)\n"
    "    except (ProcessLookupError, PermissionError):\n"
    "        pass\n"
)


def _dies_with(parent: int) -> Callable[[], None]:
    """A ``preexec_fn``: the child gets SIGKILL when ``parent`` ends (Linux), and ends now if it already has."""

    def set_parent_death_signal() -> None:
        if sys.platform != "linux":
            return
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent ended before the signal was set: nobody would stop this child
            os.kill(os.getpid(), signal.SIGKILL)

    return set_parent_death_signal


def signal_group(group: int, signum: int) -> bool:
    """Sends ``signum`` to a process group; False when the group has no process left."""
    try:
        os.killpg(group, signum)
    except ProcessLookupError:
        return False
    except PermissionError:  # a group id reused by another user's processes: not ours
        return False
    return True


class SupervisedGroup:
    """A command running in a process group of its own that ends with this process (see the module docstring).

    Args:
        argv: The command.
        env: Its whole environment.
        stdout: Where its output goes (None: this process's).
        stderr: Where its errors go (None: this process's; ``subprocess.STDOUT``: with its output).

    Raises:
        OSError: the command could not start.
    """

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        stdout: IO[Any] | int | None = None,
        stderr: IO[Any] | int | None = None,
    ) -> None:
        self.process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            env=env,
            start_new_session=True,
            preexec_fn=_dies_with(os.getpid()),
        )
        try:
            self.watchdog: subprocess.Popen[bytes] | None = subprocess.Popen(
                [sys.executable, "-c", WATCHDOG, str(self.process.pid)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError:
            signal_group(self.process.pid, signal.SIGKILL)
            self.process.wait()
            raise

    @property
    def group(self) -> int:
        """The process group's id: the leader's pid (``start_new_session``)."""
        return self.process.pid

    def exit_status(self, wait_s: float = 0.0) -> int | None:
        """The command's exit status; None while it runs (after waiting up to ``wait_s`` for it to end)."""
        try:
            return self.process.wait(timeout=wait_s) if wait_s > 0 else self.process.poll()
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM to the group, SIGKILL after ``grace_s``; returns once no process of the group is left."""
        signal_group(self.group, signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            signal_group(self.group, signal.SIGKILL)
            self.process.wait()
        # The leader gone, its engine processes may still be shutting down: the next server needs the cores.
        deadline = time.monotonic() + grace_s
        while signal_group(self.group, 0):
            if time.monotonic() > deadline:
                signal_group(self.group, signal.SIGKILL)
                break
            time.sleep(GROUP_POLL_S)
        self._release_watchdog()

    def _release_watchdog(self) -> None:
        """Tells the watchdog the group is stopped, so that it never signals a group id the system may reuse."""
        if self.watchdog is None:
            return
        if self.watchdog.stdin is not None:  # always: it was started with stdin=PIPE
            try:
                self.watchdog.stdin.write(b"done")
                self.watchdog.stdin.close()
            except BrokenPipeError:  # the watchdog was killed: nothing to tell it
                pass
        self.watchdog.wait()
        self.watchdog = None


def run_in_foreground(argv: list[str], env: dict[str, str]) -> int:
    """Runs ``argv`` as a :class:`SupervisedGroup`, as if this process were it: SIGINT, SIGTERM and SIGHUP sent here
    go to its group; its exit status is returned (128 + N for a signal N, as a shell reports it), and no process of
    its group is left when this returns, or when this process is killed.
    """
    group = SupervisedGroup(argv, env)

    def forward(signum: int, _frame: Any) -> None:
        signal_group(group.group, signum)

    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        status = group.process.wait()
    finally:
        group.stop()  # the API server gone, its engine processes may be left; normally a no-op
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 128 - status if status < 0 else status
