"""Rules of the code's structure, read from the source: each fails when the rule is broken again."""

from __future__ import annotations

import re

from tests.fixtures.pipeline import REPO

PACKAGE = REPO / "src" / "eaglenest"


def test_no_stage_asks_which_executor_runs_it():
    """Stages ask the executor what it offers (core/executor.py), never which one it is: a new executor must not
    mean an edit to every stage."""
    asks = re.compile(r"\bexecutor\s*(?:==|!=|\bin\b|\bis\b)|executor\.kind\b|\bcluster\.output\b")
    found = [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
             for path in sorted((PACKAGE / "stages").rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if asks.search(line)]
    assert found == [], "\n".join(found)


def test_the_missing_ray_error_has_one_home():
    """One sentence, in one place, for every way to a Ray cluster without Ray installed."""
    homes = [path.relative_to(REPO) for path in sorted(PACKAGE.rglob("*.py")) if "needs Ray, which" in
             path.read_text()]
    counts = {path: (REPO / path).read_text().count("needs Ray, which") for path in homes}
    assert counts == {PACKAGE.relative_to(REPO) / "core" / "executor.py": 1}
