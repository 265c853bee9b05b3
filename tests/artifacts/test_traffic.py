"""A traffic folder (``eaglenest serve --record DIR``): appends from several processes at once never lose or
interleave a line and rotate files at the size limit; a line cut by a crash is counted and passed over, and the next
append starts a new file; a corrupt or malformed line is refused naming its file, line and field."""

from __future__ import annotations

import json
import multiprocessing
import stat
from pathlib import Path
from typing import Any

import pytest

from eaglenest.artifacts.traffic import LOCK_NAME, TrafficWriter, file_name, traffic_files, utc_now
from eaglenest.artifacts.traffic.records import read_traffic
from eaglenest.core.errors import InputFileError

WORKERS = 4
PER_WORKER = 200
# Small enough that the 800 lines below fill dozens of files, so that rotation happens while the writers contend.
MAX_FILE_BYTES = 4096


def record(worker: int, index: int, **changes: Any) -> dict[str, Any]:
    """A valid line: the worker and index in the messages and the reply, a multi-byte character in each."""
    line = {
        "version": 1,
        "time": utc_now(),
        "endpoint": "chat",
        "model": "tiny/llama",
        "draft": "ab" * 32,
        "k": 2,
        "messages": [{"role": "user", "content": f"prompt é {worker}-{index} " + "x" * (index % 37)}],
        "prompt": None,
        "reply": f"reply ü {worker}-{index}",
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 7, "completion_tokens": 3},
        "acceptance": {
            "mean_acceptance_length": 1.5,
            "draft_acceptance_rate": 0.25,
            "num_spec_steps": 2,
            "num_draft_tokens": 4,
            "num_accepted_draft_tokens": 1,
            "num_spec_tokens": 2,
        },
    }
    line.update(changes)
    return line


def append_many(directory: str, worker: int, count: int, max_file_bytes: int, start: Any) -> None:
    """One writer process: waits for the others (``start``, a barrier), then appends ``count`` records at once."""
    writer = TrafficWriter(Path(directory), max_file_bytes)
    start.wait(timeout=60)
    for index in range(count):
        writer.append(record(worker, index))
    writer.close()


def write_lines(directory: Path, lines: list[dict[str, Any]]) -> Path:
    """Appends ``lines`` with one writer; returns the (single) file they went to."""
    writer = TrafficWriter(directory)
    targets = {writer.append(line) for line in lines}
    writer.close()
    assert len(targets) == 1
    return targets.pop()


def test_four_processes_appending_at_once_lose_and_interleave_nothing_and_rotate_at_the_limit(tmp_path: Path):
    """4 spawned processes × 200 appends at once, with files of 4 KiB: all 800 records read back intact (messages
    and reply round-trip), each once, each writer's in its own order; no file past the limit, no cut line; the
    folder is 0700 and every file (the lock too) 0600."""
    directory = tmp_path / "traffic"
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(WORKERS)
    workers = [
        context.Process(target=append_many, args=(str(directory), worker, PER_WORKER, MAX_FILE_BYTES, start))
        for worker in range(WORKERS)
    ]
    for process in workers:
        process.start()
    for process in workers:
        process.join(timeout=120)
    assert [process.exitcode for process in workers] == [0] * WORKERS

    log = read_traffic(directory, "test")
    assert log.cut_lines == 0 and len(log.requests) == WORKERS * PER_WORKER
    seen: dict[int, list[int]] = {worker: [] for worker in range(WORKERS)}
    order = []
    for request in log.requests:
        line = request.record
        worker, index = (int(part) for part in line.reply.removeprefix("reply ü ").split("-"))
        assert line.model_dump(mode="json") == record(worker, index, time=line.time)
        seen[worker].append(index)
        order.append(worker)
    # none lost or doubled, and each writer's lines in the order it appended them
    assert seen == {worker: list(range(PER_WORKER)) for worker in range(WORKERS)}
    switches = sum(a != b for a, b in zip(order, order[1:], strict=False))
    assert switches > WORKERS - 1, "the writers ran one after another: no contention was tested"

    files = traffic_files(directory)
    sizes = [path.stat().st_size for path in files]
    assert len(files) > 10 and files == [directory / file_name(n) for n in range(1, len(files) + 1)]
    assert all(size <= MAX_FILE_BYTES for size in sizes), sizes
    assert all(path.read_bytes().endswith(b"\n") for path in files)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for path in [*files, directory / LOCK_NAME]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    print(
        f"{WORKERS * PER_WORKER} lines from {WORKERS} processes in {len(files)} files of at most {max(sizes)} bytes, "
        f"the writer changing {switches} times"
    )


@pytest.mark.parametrize("cut", [b'{"version":1,"time":"2026-', '{"reply":"é'.encode()[:-1]], ids=["ascii", "in-utf8"])
def test_a_cut_last_line_is_counted_and_the_next_append_starts_a_new_file(tmp_path: Path, cut: bytes):
    """A line cut by a crash (a partial line without its newline, ending in text or inside a UTF-8 character) is
    counted in ``cut_lines``, never read as data; the next append goes to a new file, never after the cut line; every
    complete record still reads back, the cut file's and the new file's."""
    directory = tmp_path / "traffic"
    first = write_lines(directory, [record(0, i) for i in range(3)])
    assert first.name == file_name(1)
    with open(first, "ab") as fh:  # as a writer killed in the middle of its write leaves it
        fh.write(cut)

    log = read_traffic(directory, "test")
    assert log.cut_lines == 1 and [r.record.reply for r in log.requests] == [f"reply ü 0-{i}" for i in range(3)]
    assert [r.origin for r in log.requests] == [f"{file_name(1)}:{i}" for i in (1, 2, 3)]

    writer = TrafficWriter(directory)
    after = [writer.append(record(1, i)) for i in range(2)]
    writer.close()
    assert after == [directory / file_name(2)] * 2
    assert first.read_bytes().endswith(cut)  # the cut file is left as it was

    log = read_traffic(directory, "test")
    assert log.cut_lines == 1
    assert [r.record.reply for r in log.requests] == [f"reply ü 0-{i}" for i in range(3)] + [
        f"reply ü 1-{i}" for i in range(2)
    ]
    assert [r.origin for r in log.requests][-2:] == [f"{file_name(2)}:1", f"{file_name(2)}:2"]


@pytest.mark.parametrize(
    "bad", [b"{not json", b'{"version":1,"time":"2026-01-01T00:00:00.000000Z"', b"\xff\xfe not utf-8"]
)
def test_a_corrupt_middle_line_is_refused_naming_its_file_and_line(tmp_path: Path, bad: bytes):
    """A line in the middle of a file that is not a whole record (not JSON, a truncated object with a newline after
    it, not UTF-8) is no crash's cut line: reading refuses it with an InputFileError naming the file and the line."""
    directory = tmp_path / "traffic"
    path = write_lines(directory, [record(0, i) for i in range(3)])
    lines = path.read_bytes().split(b"\n")
    path.write_bytes(b"\n".join([lines[0], bad, *lines[2:]]))

    with pytest.raises(InputFileError) as refused:
        read_traffic(directory, "prepare.source traffic:x")
    message = str(refused.value)
    assert str(path) in message and "line 2" in message and "\n" not in message
    if not bad.startswith(b"\xff"):
        assert message.startswith(f"prepare.source traffic:x: {path}: line 2: ")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ("drop reply", "reply"),
        ("drop version", "version"),
        ("extra secret", "secret"),
        ("bad endpoint", "endpoint"),
        ("bad acceptance", "acceptance.draft_acceptance_rate"),
    ],
)
def test_a_record_missing_a_field_or_with_an_extra_one_is_refused_naming_the_field(
    tmp_path: Path, change: str, field: str
):
    """A line that is JSON but not a record (a field missing, one the format does not know, a value out of its
    range) is refused naming the file, the line and the field."""
    line = record(0, 1)
    if change.startswith("drop"):
        del line[field]
    elif change == "extra secret":
        line["secret"] = "hunter2"
    elif change == "bad endpoint":
        line["endpoint"] = "embeddings"
    else:
        line["acceptance"] = {**line["acceptance"], "draft_acceptance_rate": 1.5}
    directory = tmp_path / "traffic"
    directory.mkdir(mode=0o700)
    path = directory / file_name(1)
    path.write_text(json.dumps(record(0, 0)) + "\n" + json.dumps(line) + "\n")

    with pytest.raises(InputFileError) as refused:
        read_traffic(directory, "test")
    assert str(refused.value).startswith(f"test: {path}: line 2: {field}: ")


def test_a_chat_record_without_messages_and_a_folder_without_files_are_refused(tmp_path: Path):
    """A chat line with no messages is refused naming its line; a folder with no traffic file, or no folder at all,
    is refused naming the folder."""
    directory = tmp_path / "traffic"
    with pytest.raises(InputFileError, match="is not a folder"):
        read_traffic(directory, "test")
    directory.mkdir()
    with pytest.raises(InputFileError, match="holds no traffic-NNNNNN.jsonl file"):
        read_traffic(directory, "test")
    path = write_lines(directory, [record(0, 0, messages=[])])
    with pytest.raises(InputFileError, match=f"{path}: line 1: a chat record without messages"):
        read_traffic(directory, "test")
