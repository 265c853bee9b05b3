"""Served traffic as files: what ``eaglenest serve --record DIR`` writes and prepare's ``traffic:DIR`` source reads.

A folder of JSONL files, ``traffic-000001.jsonl``, ``traffic-000002.jsonl``, ..., one line per answered request,
appended in the order requests finish. A file is closed (the next number started) once it would grow past the
recorder's size limit, and also where its last line was cut (a server killed in the middle of a write): a later
line never follows a cut one, so a reader meets a cut line only at the end of a file, where it is counted and
passed over, never read as data. Every append holds ``flock`` on ``.traffic.lock`` in the folder, so the API server
processes of one server, and servers restarted or started side by side on one folder, never interleave lines.
The folder is created 0700 and its files 0600: recorded prompts are the users' words.

One line (``RECORD_VERSION`` 1)::

    {"version": 1, "time": "2026-12-05T23:10:00.123456Z", "endpoint": "chat", "model": "<served name>",
     "draft": "<sha256 of the draft, or null>", "k": 2,
     "messages": [{"role": "user", "content": "..."}],        # chat: the request's messages
     "prompt": null,                                          # completion: the prompt (text or token ids)
     "reply": "...", "finish_reason": "stop",
     "usage": {"prompt_tokens": 31, "completion_tokens": 64},
     "acceptance": {"mean_acceptance_length": 1.6, "draft_acceptance_rate": 0.3, "num_spec_steps": 40,
                    "num_draft_tokens": 80, "num_accepted_draft_tokens": 24, "num_spec_tokens": 2}}

``acceptance`` is vLLM's per-request speculative-decoding summary (the response's
``metrics.speculative_decoding``); null where the server did not draft (a baseline) or vLLM gave none (n > 1).
Reading a folder back, each line checked: :mod:`.records` (pydantic, which the recorder's command line must not
import).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RECORD_VERSION = 1
TRAFFIC_PREFIX = "traffic:"
FILE_NAME = re.compile(r"^traffic-(\d{6})\.jsonl$")
LOCK_NAME = ".traffic.lock"
# A file is closed once the next line would take it past this size: files small enough to move, copy or drop one
# at a time, large enough that a month of a busy server is hundreds of files, not millions.
DEFAULT_MAX_FILE_BYTES = 64 * 2**20
# The acceptance fields kept of vLLM's summary (the histogram and per-step arrays stay out: K-long lists per line).
ACCEPTANCE_FIELDS = (
    "mean_acceptance_length",
    "draft_acceptance_rate",
    "num_spec_steps",
    "num_draft_tokens",
    "num_accepted_draft_tokens",
    "num_spec_tokens",
)


def file_name(number: int) -> str:
    """The name of the ``number``-th file of a traffic folder."""
    return f"traffic-{number:06d}.jsonl"


def traffic_files(directory: Path) -> list[Path]:
    """The folder's traffic files, oldest first (by their number, which only grows)."""
    if not directory.is_dir():
        return []
    named = [(int(match.group(1)), path) for path in directory.iterdir() if (match := FILE_NAME.match(path.name))]
    return [path for _, path in sorted(named)]


def utc_now() -> str:
    """The time a line records: UTC, ISO 8601 to the microsecond, so that lines sort by time as text."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class TrafficWriter:
    """Appends records to a traffic folder: one ``write`` of one whole line per record, under the folder's lock.

    Safe under concurrent requests in one process, several processes on one folder, and restarts: every append
    takes the lock, looks at the newest file and appends to it, or starts the next one where that file is full or
    ends in a cut line.

    Args:
        directory: The traffic folder (created 0700 where missing).
        max_file_bytes: Start a new file where the next line would take the newest past this size.
    """

    def __init__(self, directory: Path, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> None:
        if max_file_bytes < 1:
            raise ValueError(f"max_file_bytes {max_file_bytes}: expected at least 1")
        self.directory = Path(directory)
        self.max_file_bytes = max_file_bytes
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock_fd = os.open(
            self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )

    def close(self) -> None:
        os.close(self._lock_fd)

    def _target(self, line_bytes: int) -> Path:
        """The file the next line goes to (called under the lock)."""
        files = traffic_files(self.directory)
        if not files:
            return self.directory / file_name(1)
        newest = files[-1]
        number = int(FILE_NAME.match(newest.name).group(1))  # type: ignore[union-attr]
        size = newest.stat().st_size
        if size == 0:
            return newest
        with open(newest, "rb") as fh:
            fh.seek(size - 1)
            cut = fh.read(1) != b"\n"  # a writer died mid-line: never append after a cut line
        if cut or size + line_bytes > self.max_file_bytes:
            return self.directory / file_name(number + 1)
        return newest

    def append(self, record: dict[str, Any]) -> Path:
        """Appends one record as one line; returns the file it went to.

        Raises:
            OSError: the folder cannot be written (full disk, permissions).
        """
        line = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            target = self._target(len(line))
            fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                view = memoryview(line)
                while view:  # one write, unless the kernel takes less (a signal, a full pipe of a FUSE mount)
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            return target
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
