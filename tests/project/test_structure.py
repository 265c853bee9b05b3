"""Rules of the code's structure that hold from now on, read from the source."""

from __future__ import annotations

from tests.fixtures.pipeline import REPO

SRC = REPO / "src" / "eaglenest"


def test_only_the_hidden_state_artifact_asks_whether_a_layout_holds_row_files():
    """``rows_per_shard == 1`` (one file per row) is answered by the layout's ``row_files``: one place decides it."""
    owner = SRC / "artifacts" / "hidden_states"
    offenders = [f"{path.relative_to(REPO)}:{number}"
                 for path in sorted(SRC.rglob("*.py")) if owner not in path.parents
                 for number, line in enumerate(path.read_text().splitlines(), 1) if "rows_per_shard == 1" in line]
    assert not offenders, f"ask the layout's row_files instead: {offenders}"
