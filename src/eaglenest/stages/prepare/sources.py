"""Reading conversations: the built-in sets (chitchat, Python functions to complete, documentation excerpts to
summarize, short and long; math word problems) and ShareGPT / OpenAI-style files.

Every source yields :class:`Conversation` objects — a list of ``{"role", "content"}`` messages with roles
``system``, ``user`` and ``assistant`` — tagged with where they came from (file and record number), so a
malformed record stops the stage with its path and record number.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.core.errors import InputFileError, ParamsError
from eaglenest.core.params import BUILTIN_PREFIX
from eaglenest.core.registry import Registry

# ShareGPT's speaker names and OpenAI's roles, mapped onto the chat template's roles.
ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
}
FILE_SUFFIXES = (".json", ".jsonl", ".parquet")


@dataclass(frozen=True)
class Conversation:
    """One conversation and where it came from.

    Attributes:
        origin: "path:record" (record numbers are 1-based lines for JSONL, 0-based items otherwise).
        messages: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``.
    """

    origin: str
    messages: list[dict[str, str]]


def _chitchat() -> Iterator[Conversation]:
    """The chitchat-dataset package: two people; the one who speaks first is the user."""
    import chitchat_dataset

    for conv_id, conv in chitchat_dataset.Dataset().items():
        first_sender = conv["messages"][0][0]["sender"] if conv["messages"] else None
        messages = []
        for group in conv["messages"]:  # a group is consecutive utterances of one sender
            text = "\n".join(u["text"].strip() for u in group if u["text"].strip())
            if not text:
                continue
            role = "user" if group[0]["sender"] == first_sender else "assistant"
            if messages and messages[-1]["role"] == role:  # merge a sender's split groups
                messages[-1]["content"] += "\n" + text
            else:
                messages.append({"role": role, "content": text})
        yield Conversation(origin=f"chitchat:{conv_id}", messages=messages)


# Code to complete from its signature and docstring, from the interpreter's standard library: a snapshot
# (scripts/snapshot_python_functions.py writes it; committed, and under data/conversations, a prepare dependency).
PYTHON_FUNCTIONS_FILE = Path(__file__).resolve().parents[4] / "data" / "conversations" / "python-functions.jsonl"


def _python_functions() -> Iterator[Conversation]:
    """The snapshot's functions: the def line(s) and docstring as the user turn, the body as the reply."""
    return read_file(PYTHON_FUNCTIONS_FILE, BUILTIN_PREFIX + "python-functions")


# Documentation excerpts to summarize or answer from, from installed packages' READMEs: snapshots written by
# scripts/snapshot_package_docs.py (short excerpts, for 512-token rows) and scripts/snapshot_long_readmes.py
# (600 to 1,500 tokens), committed under data/conversations. Prompts only.
PACKAGE_DOCS_FILE = PYTHON_FUNCTIONS_FILE.with_name("package-docs.jsonl")
LONG_READMES_FILE = PYTHON_FUNCTIONS_FILE.with_name("long-readmes.jsonl")


def _prompts(path: Path, name: str, script: str) -> Iterator[Conversation]:
    """A prompt snapshot's records, each a user prompt with an empty reply for the verifier to write; their origin
    names the built-in source ``name``, never the checkout's path."""
    for label, record in _read_records(path):
        prompt = record.get("prompt") if isinstance(record, dict) else None
        if not isinstance(prompt, str) or not prompt.strip():
            raise InputFileError(f"{path}: {label}: expected {{'prompt': '...'}}; rerun scripts/{script}")
        yield Conversation(
            origin=f"{BUILTIN_PREFIX}{name}: {label}",
            messages=[{"role": "user", "content": prompt}, {"role": "assistant", "content": ""}],
        )


def _package_docs() -> Iterator[Conversation]:
    """The short README excerpts (builtin:package-docs)."""
    return _prompts(PACKAGE_DOCS_FILE, "package-docs", "snapshot_package_docs.py")


def _long_readmes() -> Iterator[Conversation]:
    """The long README excerpts (builtin:long-readmes)."""
    return _prompts(LONG_READMES_FILE, "long-readmes", "snapshot_long_readmes.py")


def _math_problems() -> Iterator[Conversation]:
    """Grade-school word problems from templates (builtin:math-problems), each with an empty reply."""
    from eaglenest.stages.prepare.math_problems import math_problems

    for number, problem in enumerate(math_problems()):
        yield Conversation(
            origin=f"builtin:math-problems:{number}",
            messages=[{"role": "user", "content": problem}, {"role": "assistant", "content": ""}],
        )


BUILTIN_SOURCES: Registry[Callable[[], Iterator[Conversation]]] = Registry("built-in conversation source")
BUILTIN_SOURCES.register("chitchat", _chitchat)
BUILTIN_SOURCES.register("python-functions", _python_functions)
BUILTIN_SOURCES.register("package-docs", _package_docs)
BUILTIN_SOURCES.register("long-readmes", _long_readmes)
BUILTIN_SOURCES.register("math-problems", _math_problems)
# Built-in sources of prompts without replies: the verifier writes them (prepare.regenerate: true).
PROMPT_ONLY_SOURCES = tuple(BUILTIN_PREFIX + name for name in ("package-docs", "long-readmes", "math-problems"))
# Built-in sources whose prompts need long rows: the prepare.max_len they need (a shorter one would drop them all).
LONG_ROW_SOURCES = {BUILTIN_PREFIX + "long-readmes": 2048}  # its longest prompt: 1,959 SmolLM2 tokens


def _normalise_turn(turn: Any, where: str, index: int) -> dict[str, str]:
    if not isinstance(turn, dict):
        raise InputFileError(f"{where}: turn {index} is a {type(turn).__name__}, expected an object")
    if "from" in turn or "value" in turn:
        role_key, content_key = "from", "value"
    else:
        role_key, content_key = "role", "content"
    if role_key not in turn:
        raise InputFileError(f"{where}: turn {index} has no '{role_key}'")
    raw_role = turn[role_key]
    role = ROLE_ALIASES.get(str(raw_role).lower()) if isinstance(raw_role, str) else None
    if role is None:
        raise InputFileError(f"{where}: turn {index} has role {raw_role!r}; allowed: {', '.join(sorted(ROLE_ALIASES))}")
    content = turn.get(content_key)
    if not isinstance(content, str):
        raise InputFileError(
            f"{where}: turn {index} ('{role}') has {content_key!r} = {content!r:.60}; expected a string"
        )
    if not content.strip():
        raise InputFileError(f"{where}: turn {index} ('{role}') is empty")
    reasoning = turn.get("reasoning_content")
    if role == "assistant" and isinstance(reasoning, str) and reasoning.strip():
        # A reasoning model's thinking, as OpenAI-style APIs return it; reasoning chat templates render it.
        return {"role": role, "content": content, "reasoning_content": reasoning}
    return {"role": role, "content": content}


def normalise_record(record: Any, where: str) -> list[dict[str, str]]:
    """A ShareGPT or OpenAI-style record as a list of role/content messages.

    Raises:
        InputFileError: naming ``where`` (file and record) and what is wrong.
    """
    if not isinstance(record, dict):
        raise InputFileError(f"{where}: a record must be an object, got {type(record).__name__}")
    for key in ("conversations", "messages"):
        if key in record:
            turns = record[key]
            break
    else:
        raise InputFileError(
            f"{where}: record has neither 'conversations' (ShareGPT) nor 'messages' (OpenAI-style); "
            f"keys: {sorted(record)[:8]}"
        )
    if not isinstance(turns, list) or not turns:
        raise InputFileError(f"{where}: '{key}' must be a non-empty list of turns")
    return [_normalise_turn(turn, where, i) for i, turn in enumerate(turns)]


def _read_records(path: Path) -> Iterator[tuple[str, Any]]:
    """(record label, raw record) pairs of one file."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".jsonl":
            with open(path, encoding="utf-8") as fh:
                for line_no, line in enumerate(fh, start=1):
                    if line.strip():
                        try:
                            yield f"line {line_no}", json.loads(line)
                        except json.JSONDecodeError as err:
                            raise InputFileError(f"{path}: line {line_no}: not valid JSON: {err.msg}") from None
        elif suffix == ".json":
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as err:
                raise InputFileError(f"{path}: not valid JSON at line {err.lineno}: {err.msg}") from None
            if isinstance(data, dict) and ("conversations" in data or "messages" in data):
                data = [data]
            if not isinstance(data, list):
                raise InputFileError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
            for index, record in enumerate(data):
                yield f"record {index}", record
        elif suffix == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            try:
                table = pq.read_table(path)
            except (pa.ArrowException, OSError, ValueError) as err:
                raise InputFileError(f"{path}: not a readable parquet file: {err}") from None
            for index, record in enumerate(table.to_pylist()):
                yield f"row {index}", record
        else:
            raise InputFileError(f"{path}: unsupported file type {suffix!r}; allowed: {', '.join(FILE_SUFFIXES)}")
    except UnicodeDecodeError as err:
        raise InputFileError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason})") from None
    except FileNotFoundError:
        raise InputFileError(f"{path}: file not found (prepare.source)") from None
    except IsADirectoryError:
        raise InputFileError(f"{path}: is a directory; list the files in prepare.source") from None


def read_file(path: Path, name: str | None = None) -> Iterator[Conversation]:
    """Every conversation in one JSON, JSONL or parquet file.

    Args:
        path: The file.
        name: What origins call the file; None is ``path`` as given. Origins land in the prepared data, so a
            built-in source names itself: an absolute path would make a clone elsewhere hash differently.
    """
    for label, record in _read_records(path):
        where = f"{path}: {label}"
        origin = where if name is None else f"{name}: {label}"
        yield Conversation(origin=origin, messages=normalise_record(record, where))


def read_source(source: str) -> list[Conversation]:
    """Every conversation of one ``prepare.source`` entry (a built-in data set or a file), in order."""
    if source.startswith(BUILTIN_PREFIX):
        name = source.removeprefix(BUILTIN_PREFIX)
        if name not in BUILTIN_SOURCES:
            allowed = ", ".join(BUILTIN_PREFIX + n for n in [*BUILTIN_SOURCES.names(), "self-instruct"])
            raise ParamsError(f"prepare.source: {source!r} is not a built-in source; allowed: {allowed}")
        return list(BUILTIN_SOURCES.get(name)())
    path = Path(source)
    # a file inside the checkout given by its absolute path is named relative to the checkout (stages run at its
    # root), so the prepared data is the same in every clone
    inside = path.is_absolute() and path.is_relative_to(Path.cwd())
    return list(read_file(path, str(path.relative_to(Path.cwd())) if inside else None))


def read_sources(sources: list[str]) -> list[Conversation]:
    """Every conversation of several sources, in order (each as :func:`read_source` reads it)."""
    return [conversation for source in sources for conversation in read_source(source)]
