"""Each input format reads into role/content messages; a malformed record names its file and number."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eaglenest.core.errors import InputFileError, ParamsError
from eaglenest.core.registry import Registry
from eaglenest.stages.prepare.sources import BUILTIN_SOURCES, read_file, read_sources
from tests.fixtures.models import write_jsonl

SHAREGPT = {
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello!"},
    ]
}
OPENAI = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
EXPECTED_SHAREGPT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
]


def test_sharegpt_jsonl(tmp_path: Path):
    [conv] = read_file(write_jsonl(tmp_path / "a.jsonl", [SHAREGPT]))
    assert conv.messages == EXPECTED_SHAREGPT
    assert conv.origin.endswith("a.jsonl: line 1")


def test_openai_json_list(tmp_path: Path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps([OPENAI, SHAREGPT]))
    convs = list(read_file(path))
    assert convs[0].messages == OPENAI["messages"]
    assert convs[1].messages == EXPECTED_SHAREGPT


def test_parquet_both_styles(tmp_path: Path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist([OPENAI]), path)
    pq.write_table(pa.Table.from_pylist([SHAREGPT]), tmp_path / "b.parquet")
    assert [c.messages for c in read_sources([str(path), str(tmp_path / "b.parquet")])] == [
        OPENAI["messages"],
        EXPECTED_SHAREGPT,
    ]


def test_builtin_chitchat_alternates_user_and_assistant():
    convs = list(BUILTIN_SOURCES.get("chitchat")())
    assert len(convs) > 4000
    two_person = [c for c in convs if len(c.messages) > 1]
    assert len(two_person) > 3500
    for conv in two_person[:200]:
        roles = [m["role"] for m in conv.messages]
        assert roles[0] == "user"
        assert all(a != b for a, b in zip(roles, roles[1:], strict=False))  # merged, so strictly alternating


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            '{"messages": []}\n{"messages": [{"role": "user", "content": "x"}]}\n{bad json\n',
            r"a.jsonl: line 1: 'messages' must be a non-empty list",
        ),
        ('{"messages": [{"role": "user", "content": "x"}]}\n{bad json\n', r"a.jsonl: line 2: not valid JSON"),
        ('{"messages": [{"role": "robot", "content": "x"}]}\n', r"line 1: turn 0 has role 'robot'; allowed: "),
        ('{"messages": [{"content": "x"}]}\n', r"line 1: turn 0 has no 'role'"),
        ('{"messages": [{"role": "user", "content": "  "}]}\n', r"line 1: turn 0 \('user'\) is empty"),
        ('{"messages": [{"role": "user", "content": 3}]}\n', r"line 1: turn 0 \('user'\) has 'content' = 3"),
        ('{"text": "x"}\n', r"line 1: record has neither 'conversations' \(ShareGPT\) nor 'messages'"),
        ("[1, 2]\n", r"line 1: a record must be an object, got list"),
    ],
)
def test_malformed_jsonl_names_file_and_record(tmp_path: Path, content: str, message: str):
    path = tmp_path / "a.jsonl"
    path.write_text(content)
    with pytest.raises(InputFileError, match=message):
        list(read_file(path))


def test_non_utf8_file(tmp_path: Path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n')
    with pytest.raises(InputFileError, match=r"a.jsonl: not UTF-8 text"):
        list(read_file(path))


def test_bad_json_file_and_wrong_suffix_and_missing(tmp_path: Path):
    (tmp_path / "a.json").write_text("{")
    with pytest.raises(InputFileError, match=r"a.json: not valid JSON at line 1"):
        list(read_file(tmp_path / "a.json"))
    (tmp_path / "a.csv").write_text("x")
    with pytest.raises(InputFileError, match=r"unsupported file type '.csv'; allowed: .json, .jsonl, .parquet"):
        list(read_file(tmp_path / "a.csv"))
    with pytest.raises(InputFileError, match=r"nope.jsonl: file not found"):
        list(read_file(tmp_path / "nope.jsonl"))


def test_corrupt_parquet(tmp_path: Path):
    (tmp_path / "a.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(InputFileError, match=r"a.parquet: not a readable parquet file"):
        list(read_file(tmp_path / "a.parquet"))


def test_unknown_builtin_source_lists_known():
    with pytest.raises(ParamsError, match=r"'builtin:nope' is not a built-in source; allowed: builtin:chitchat"):
        read_sources(["builtin:nope"])


def test_registry_refuses_duplicates_and_lists_names():
    registry: Registry[int] = Registry("thing")
    registry.register("b", 1)
    registry.register("a", 2)
    with pytest.raises(ValueError, match="thing 'a' is already registered"):
        registry.register("a", 3)
    with pytest.raises(KeyError, match="unknown thing 'c'; known: a, b"):
        registry.get("c")
