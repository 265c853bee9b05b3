"""Reading a traffic folder back (:mod:`eaglenest.artifacts.traffic` has the layout): every line checked."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from eaglenest.artifacts.traffic import traffic_files
from eaglenest.core.errors import InputFileError


class Acceptance(BaseModel):
    """vLLM's per-request speculative-decoding summary, as a line keeps it."""

    model_config = ConfigDict(extra="ignore")

    mean_acceptance_length: float = Field(ge=0.0, description="Tokens per verify step, the bonus token included.")
    draft_acceptance_rate: float = Field(ge=0.0, le=1.0, description="Accepted draft tokens / drafted tokens.")
    num_spec_steps: int = Field(default=0, ge=0, description="Verify steps.")
    num_draft_tokens: int = Field(default=0, ge=0, description="Draft tokens proposed.")
    num_accepted_draft_tokens: int = Field(default=0, ge=0, description="Draft tokens accepted.")
    num_spec_tokens: int = Field(default=0, ge=0, description="K, the drafts per verify step.")


class TrafficRecord(BaseModel):
    """One line of a traffic file."""

    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = Field(description="The line format's version.")
    time: str = Field(min_length=20, description="When the answer finished, UTC, ISO 8601 (sorts as text).")
    endpoint: Literal["chat", "completion"] = Field(description="/v1/chat/completions or /v1/completions.")
    model: str | None = Field(default=None, description="The model name the request asked for.")
    draft: str | None = Field(default=None, description="sha256 of the served draft; null: no draft served.")
    k: int | None = Field(default=None, description="The K served; null: no drafting.")
    messages: list[dict[str, Any]] | None = Field(default=None, description="chat: the request's messages.")
    prompt: str | list[int] | list[str] | None = Field(default=None, description="completion: the prompt.")
    reply: str = Field(description="The served reply (the first choice).")
    finish_reason: str | None = Field(default=None, description="Why the reply ended (stop, length).")
    usage: dict[str, Any] | None = Field(default=None, description="The response's token counts.")
    acceptance: Acceptance | None = Field(default=None, description="vLLM's per-request acceptance, if any.")


@dataclass(frozen=True)
class RecordedRequest:
    """A line read back, with where it was: ``origin`` is ``<file name>:<line>``, stable across clones."""

    origin: str
    record: TrafficRecord


@dataclass(frozen=True)
class TrafficLog:
    """Every line of a traffic folder, oldest file first, and the lines cut by a crash that were passed over."""

    requests: list[RecordedRequest]
    cut_lines: int


def read_traffic(directory: Path, what: str) -> TrafficLog:
    """Every record of a traffic folder, in file and line order.

    Args:
        directory: The folder.
        what: Who reads it, for errors (``prepare.source traffic:data/traffic``).

    Raises:
        InputFileError: no such folder, no traffic file in it, or a line that is not a record (its file and line).
    """
    if not directory.is_dir():
        raise InputFileError(f"{what}: {directory} is not a folder (record one with eaglenest serve --record)")
    files = traffic_files(directory)
    if not files:
        raise InputFileError(
            f"{what}: {directory} holds no traffic-NNNNNN.jsonl file (eaglenest serve --record {directory} writes them)"
        )
    requests: list[RecordedRequest] = []
    cut = 0
    for path in files:
        for number, text, complete in _lines(path, what):
            where = f"{what}: {path}: line {number}"
            if not complete:  # only ever a file's last line: writers start a new file after one
                cut += 1
                continue
            try:
                record = TrafficRecord.model_validate_json(text)
            except ValidationError as err:
                first = err.errors()[0]
                field = ".".join(str(p) for p in first["loc"]) or "the line"
                raise InputFileError(f"{where}: {field}: {first['msg']}") from None
            if record.endpoint == "chat" and not record.messages:
                raise InputFileError(f"{where}: a chat record without messages")
            requests.append(RecordedRequest(f"{path.name}:{number}", record))
    return TrafficLog(requests, cut)


def _lines(path: Path, what: str) -> Iterator[tuple[int, str, bool]]:
    """(1-based line number, text, ends in a newline) of each non-empty line of one file."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise InputFileError(f"{what}: {path}: cannot be read ({err.strerror})") from None
    lines = raw.split(b"\n")
    for index, line in enumerate(lines):
        last = index == len(lines) - 1
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            if last:  # a cut line may end inside a character
                yield index + 1, "", False
                continue
            raise InputFileError(f"{what}: {path}: line {index + 1}: not UTF-8") from None
        yield index + 1, text, not last
