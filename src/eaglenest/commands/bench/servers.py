"""The servers ``--serve`` starts: ``eaglenest serve``'s command, a process group of its own, stopped whatever ends the
bench.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eaglenest.commands.bench.config import ServeSetup
from eaglenest.commands.bench.endpoint import API_KEY_ENVS, answers
from eaglenest.commands.bench.load import failure_line
from eaglenest.commands.supervised import SupervisedGroup
from eaglenest.core.errors import EaglenestError

SERVER_HOST = "127.0.0.1"
SERVER_POLL_S = 0.5


def server_command(serve: ServeSetup, model: str | None, baseline: str | None, cpu_build: bool) -> Any:
    """``eaglenest serve``'s command for the draft server (``baseline`` None) or a baseline one, on ``--port``; the
    draft's with the schedule of ``--schedule`` where it is of this draft at the K served (not with
    ``--measure-schedule``).

    Returns:
        A :class:`eaglenest.commands.serve.command.ServeCommand`.
    """
    from eaglenest.commands.serve.access import API_KEY_ENV
    from eaglenest.commands.serve.command import OWN_FLAGS, ServeOptions, build_command

    for arg in serve.vllm_args:
        flag = arg.split("=", 1)[0]
        if flag == "--api-key":  # bench must send the key it gives: one variable holds it for both ends
            raise EaglenestError(
                f"--api-key after --: eaglenest bench --serve starts its servers with the key of "
                f"{API_KEY_ENV} and sends the key of {' or '.join(API_KEY_ENVS)}; export "
                f"{API_KEY_ENV}=... instead"
            )
        if flag in OWN_FLAGS:
            instead = (
                "--model"
                if flag == "--served-model-name"
                else "nothing: the servers listen on 127.0.0.1"
                if flag == "--host"
                else OWN_FLAGS[flag]
            )
            raise EaglenestError(f"{flag} after --: eaglenest bench --serve sets it; use {instead} (before --)")
    # the record is passed over, not refused, where it is of another draft or K: this bench then measures anew
    command = build_command(
        ServeOptions(
            serve.verifier,
            serve.draft,
            SERVER_HOST,
            serve.port,
            serve.dtype,
            num_speculative_tokens=serve.num_speculative_tokens,
            execution=serve.execution,
            served_model_name=model,
            vllm_args=serve.vllm_args,
            baseline=baseline,
            schedule_file=None if serve.measure_schedule else serve.schedule,
        ),
        cpu_build=cpu_build,
    )
    if baseline is None and serve.measure_schedule:
        command = dataclasses.replace(
            command,
            schedule_reason="K per batch size: none, the same K at every batch "
            f"size (--measure-schedule: measured anew, written to {serve.schedule})",
        )
    return command


class StartedServer:
    """A server bench started: a :class:`~eaglenest.commands.supervised.SupervisedGroup`, its output in a log file.

    Its own group: Ctrl-C at the terminal does not reach it (bench stops it, in order), a signal to the group
    reaches vLLM's engine processes too, and the whole group ends with bench, even when bench is killed.
    """

    def __init__(self, role: str, command: Any, url: str, log: Path) -> None:
        self.role, self.command, self.url, self.log = role, command, url, log
        self.group: SupervisedGroup | None = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as log:  # the child keeps its own descriptor
            try:
                self.group = SupervisedGroup(
                    self.command.argv, {**os.environ, **self.command.env}, stdout=log, stderr=subprocess.STDOUT
                )
            except OSError as err:
                raise EaglenestError(f"the {self.role} server did not start: {err}") from None

    @property
    def started(self) -> bool:
        return self.group is not None

    def exit_status(self, wait_s: float = 0.0) -> int | None:
        """The server's exit status; None while it runs (after waiting up to ``wait_s`` for it to end)."""
        return None if self.group is None else self.group.exit_status(wait_s)

    def wait_until_ready(self, timeout_s: float) -> float:
        """Seconds until ``/v1/models`` answered.

        Raises:
            EaglenestError: the server exited first, or stayed silent ``timeout_s`` (one line naming its log).
        """
        start = time.monotonic()
        while True:
            status = self.exit_status()
            if status is not None:
                why = failure_line(self.log.read_text(errors="replace"))
                raise EaglenestError(
                    f"the {self.role} server exited with {status} before it answered at "
                    f"{self.url}/v1/models: {why} (log: {self.log})"
                )
            if answers(self.url + "/v1/models"):
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise EaglenestError(
                    f"the {self.role} server did not answer at {self.url}/v1/models within "
                    f"--server-timeout {timeout_s:g} s (log: {self.log}); raise --server-timeout "
                    "if it was still loading"
                )
            time.sleep(SERVER_POLL_S)

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after a grace period; returns once it is gone."""
        if self.group is not None:
            self.group.stop()


@contextlib.contextmanager
def started_server(role: str, command: Any, serve: ServeSetup, log: Path) -> Iterator[StartedServer]:
    """The server, started and answering; stopped on leaving, whatever the way out."""
    from eaglenest.commands.serve.access import check_port_free

    check_port_free(SERVER_HOST, serve.port)
    server = StartedServer(role, command, f"http://{SERVER_HOST}:{serve.port}", log)
    print(f"eaglenest bench: starting the {role} server ({command.k_reason}; log: {log})", flush=True)
    try:
        server.start()
        waited = server.wait_until_ready(serve.timeout_s)
        print(f"eaglenest bench: the {role} server answers at {server.url} (after {waited:.0f} s)", flush=True)
        yield server
    finally:
        if server.started:
            server.stop()
            print(f"eaglenest bench: stopped the {role} server", flush=True)


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit while bench holds started servers, so that they are stopped on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
