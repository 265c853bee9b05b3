"""A JSON file a stage wrote, read back: the document, or one line naming the file and what to run."""

from __future__ import annotations

from pathlib import Path

import pytest

from eaglenest.core.errors import InputFileError
from eaglenest.core.json_file import read_json


def test_the_document_is_returned(tmp_path: Path):
    (tmp_path / "a.json").write_text('{"rows": [1, 2]}')
    assert read_json(tmp_path / "a.json", "missing", "run it") == {"rows": [1, 2]}


def test_a_missing_file_raises_the_callers_line(tmp_path: Path):
    with pytest.raises(InputFileError, match="^no a.json; run the stage$"):
        read_json(tmp_path / "a.json", "no a.json; run the stage", "run it")


@pytest.mark.parametrize("content", [b"{", b"\xff"])
def test_a_file_that_is_not_json_names_itself_and_the_fix(tmp_path: Path, content: bytes):
    path = tmp_path / "a.json"
    path.write_bytes(content)
    with pytest.raises(InputFileError, match=r": not readable JSON \(.+\); run it$") as raised:
        read_json(path, "missing", "run it")
    assert str(raised.value).startswith(f"{path}:")
    with pytest.raises(InputFileError, match=r"^--draft a\.json: not readable JSON"):
        read_json(path, "missing", "run it", named="--draft a.json")
