"""Where code lives and what it is called, read from the source: ``eaglenest.core`` holds only what the stages
stand on (an edit there re-runs every stage that runs the file), a name in it says one thing, one place answers
each question about a file layout, no command module mixes concerns, and no stage knows which executor runs
it."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

from tests.fixtures.pipeline import REPO

PACKAGE = REPO / "src" / "eaglenest"
CORE = PACKAGE / "core"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, lazily too, and for ``from a import b`` both ``a`` and ``a.b`` (b may be a
    module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_no_two_core_modules_define_the_same_public_name():
    """Two acts under one name (stopping a vLLM engine, closing whatever an executor built) read as one; each
    public function and class of core has a name of its own."""
    defined: dict[str, list[str]] = {}
    for path in sorted(CORE.rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                defined.setdefault(node.name, []).append(str(path.relative_to(REPO)))
    assert {name: paths for name, paths in defined.items() if len(paths) > 1} == {}


def _entry_point_modules() -> set[str]:
    """The modules pyproject.toml's entry points name: another program (vLLM, for its plugins) runs them."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    groups = [project.get("scripts", {}), *project.get("entry-points", {}).values()]
    return {target.split(":")[0] for group in groups for target in group.values()}


def test_every_core_module_is_run_by_the_package():
    """A module that only scripts or tests use is theirs, not the stages' ground (an entry point's module is run
    by the program that loads it)."""
    modules = {_module_name(path): path for path in CORE.rglob("*.py") if path.name != "__init__.py"}
    imports = {path: _imported_modules(path) for path in PACKAGE.rglob("*.py")}
    unused = sorted(
        name
        for name, own in modules.items()
        if name not in _entry_point_modules()
        and not any(name in found for path, found in imports.items() if path != own)
    )
    assert unused == []


def test_no_stages_own_section_has_its_schema_in_core():
    """A stage's own section of params.yaml has its schema beside the stage, or among the artifacts where other
    stages read it too; core keeps only what several sections share (``cluster``, the vLLM engine settings)."""
    from eaglenest.commands.params_file import SECTIONS

    in_core = {
        name: section.model.__module__
        for name, section in SECTIONS.items()
        if name != "cluster" and section.model.__module__.startswith("eaglenest.core.")
    }
    assert in_core == {}


def test_only_the_hidden_state_artifact_asks_whether_a_layout_holds_row_files():
    """``rows_per_shard == 1`` (one file per row) is answered by the layout's ``row_files``: one place decides it."""
    owner = PACKAGE / "artifacts" / "hidden_states"
    offenders = [
        f"{path.relative_to(REPO)}:{number}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if owner not in path.parents
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "rows_per_shard == 1" in line
    ]
    assert not offenders, f"ask the layout's row_files instead: {offenders}"


# A command module longer than this mixes concerns: split it by concern (as commands/bench and commands/remote are).
MAX_COMMAND_MODULE_LINES = 400


def test_no_command_module_is_over_400_lines() -> None:
    commands = PACKAGE / "commands"
    long = {
        str(path.relative_to(REPO)): count
        for path in sorted(commands.rglob("*.py"))
        if (count := len(path.read_text().splitlines())) > MAX_COMMAND_MODULE_LINES
    }
    assert not long, f"over {MAX_COMMAND_MODULE_LINES} lines (split by concern): {long}"


def test_no_stage_asks_which_executor_runs_it():
    """Stages ask the executor what it offers (core/executor.py), never which one it is: a new executor must not
    mean an edit to every stage."""
    asks = re.compile(r"\bexecutor\s*(?:==|!=|\bin\b|\bis\b)|executor\.kind\b|\bcluster\.output\b")
    found = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in sorted((PACKAGE / "stages").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if asks.search(line)
    ]
    assert found == [], "\n".join(found)


def test_the_missing_ray_error_has_one_home():
    """One sentence, in one place, for every way to a Ray cluster without Ray installed."""
    homes = [path.relative_to(REPO) for path in sorted(PACKAGE.rglob("*.py")) if "needs Ray, which" in path.read_text()]
    counts = {path: (REPO / path).read_text().count("needs Ray, which") for path in homes}
    assert counts == {PACKAGE.relative_to(REPO) / "core" / "executor.py": 1}
