"""The house's rules, read from the source.

A module's layer is read from its path: ``eaglenest.core`` is the ground, ``eaglenest.artifacts`` what stages hand
each other, ``eaglenest.stages.<name>`` stage ``<name>``, ``eaglenest.commands`` the commands. Every ``import``
counts, also those inside functions (a lazy import still ties two modules together); imports under
``if TYPE_CHECKING:`` do not run and do not count. dvc.yaml's code deps are held to each stage's import closure.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

from tests.fixtures.pipeline import REPO

PACKAGE = REPO / "src" / "eaglenest"
VLLM_MODULES = {
    "eaglenest.core.vllm_support",
    "eaglenest.artifacts.hidden_states.engines.vllm",
    "eaglenest.artifacts.hidden_states.engines.vllm_connector",
    "eaglenest.stages.evaluate.vllm",
    "eaglenest.stages.prepare.regenerate.vllm",
    "eaglenest.core.measure.engines",
    "eaglenest.core.vllm_schedule",
    "eaglenest.core.drafter.runner",
}


def _load_stage_deps():
    spec = importlib.util.spec_from_file_location("stage_deps", REPO / "scripts" / "stage_deps.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["stage_deps"] = module
    spec.loader.exec_module(module)
    return module


stage_deps = _load_stage_deps()


def all_modules() -> dict[str, Path]:
    return stage_deps.package_modules(PACKAGE.parent)


def import_graph() -> dict[str, set[str]]:
    """Module -> the eaglenest modules it imports at run time (a package import counts as its ``__init__``)."""
    modules = all_modules()
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in stage_deps.imported_names(path, name, frozenset({"eaglenest"})):
            if imported in modules and imported.startswith("eaglenest"):
                targets.add(imported)
            elif imported.rpartition(".")[0] in modules and imported.startswith("eaglenest"):
                targets.add(imported.rpartition(".")[0])  # `from pkg import name`: the package itself
        graph[name] = targets - {name}
    return graph


def external_imports(path: Path) -> set[str]:
    """Top-level packages other than eaglenest that ``path`` imports at run time."""
    return {
        name.split(".")[0]
        for name in stage_deps.imported_names(path, None)
        if not name.startswith("eaglenest") and "." not in name or name.split(".")[0] == "vllm"
    }


def layer(module: str) -> tuple[str, str | None]:
    """(layer, stage) of a module, from its dotted path: ("stage", "train"), ("core", None), ..."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return "root", None
    if parts[1] == "stages":
        return ("stage", parts[2]) if len(parts) > 2 else ("stages-package", None)
    return parts[1], None


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the list of modules around it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_every_module_sits_in_a_known_layer():
    layers = {layer(module)[0] for module in all_modules()}
    assert layers <= {"root", "core", "artifacts", "stages-package", "stage", "commands"}, layers


def test_the_import_graph_has_no_circle():
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()) or [])


def test_the_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_stage_imports_another_stage():
    crossings = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for target in targets
        if layer(module)[0] == "stage" and layer(target)[0] == "stage" and layer(target) != layer(module)
    ]
    assert crossings == []


def test_the_ground_and_the_artifacts_import_no_stage_and_no_command():
    allowed = {"core": {"root", "core"}, "artifacts": {"root", "core", "artifacts"}}
    wrong = [
        f"{module} ({layer(module)[0]}) imports {target} ({layer(target)[0]})"
        for module, targets in import_graph().items()
        for target in targets
        if layer(module)[0] in allowed and layer(target)[0] not in allowed[layer(module)[0]]
    ]
    assert wrong == []


def test_only_commands_import_commands():
    wrong = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for target in targets
        if layer(target)[0] == "commands" and layer(module)[0] not in ("commands", "root")
    ]
    assert wrong == []


def test_only_the_vllm_back_ends_import_vllm():
    importers = {name for name, path in all_modules().items() if "vllm" in external_imports(path)}
    assert importers <= VLLM_MODULES, importers - VLLM_MODULES


def test_back_ends_import_their_contract_not_their_dispatcher():
    for family in ("artifacts.hidden_states.engines", "stages.extract", "stages.evaluate", "stages.prepare.regenerate"):
        for name, targets in import_graph().items():
            if name.startswith(f"eaglenest.{family}."):
                assert f"eaglenest.{family}" not in targets, f"{name} imports its dispatcher eaglenest.{family}"


def test_every_dvc_stage_has_a_package_and_the_same_short_script():
    for stage in stage_deps.stage_names():
        package = PACKAGE / "stages" / stage / "__init__.py"
        assert package.is_file(), f"stage {stage} has no package {package}"
        assert "\nSTAGE = Stage(" in package.read_text(), f"{package} defines no STAGE"
        script = (REPO / "stages" / f"{stage}.py").read_text()
        body = script.split('"""', 2)[2]  # below the docstring: the same lines for every stage
        assert body == stage_deps_script_body(stage), f"stages/{stage}.py is not the standard entry point"


def stage_deps_script_body(stage: str) -> str:
    return (
        f'\n\nfrom _guard import require_stage_environment\n\nrequire_stage_environment("{stage}")\n\n'
        "from eaglenest.core.stage import run_stage  # noqa: E402\n"
        f"from eaglenest.stages.{stage} import STAGE  # noqa: E402\n\n"
        'if __name__ == "__main__":\n    raise SystemExit(run_stage(STAGE))\n'
    )


def test_dvc_yaml_lists_exactly_each_stages_code():
    problems = stage_deps.problems()
    assert problems == [], "\n".join(problems + ["fix: .venv/bin/python scripts/stage_deps.py --write"])


@pytest.mark.parametrize("stage", ["train", "evaluate"])
def test_a_later_stage_does_not_run_the_hidden_state_format_unless_it_reads_it(stage: str):
    deps = stage_deps.expected_code_deps(stage)
    assert any(dep.startswith("src/eaglenest/artifacts/hidden_states/") for dep in deps) == (stage == "train")
    assert "src/eaglenest/artifacts/hidden_states/resume.py" not in deps  # an extraction while it runs: extract's
    assert not any(dep.startswith("src/eaglenest/commands/") for dep in deps)


def test_the_closure_counts_lazy_imports_parents_and_module_names_but_not_type_checking(tmp_path: Path):
    src = tmp_path / "src"
    for name, text in {
        "pkg/__init__.py": "",
        "pkg/sub/__init__.py": "",
        "pkg/sub/leaf.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.typing_only\n",
        "pkg/lazy.py": "",
        "pkg/by_name.py": "",
        "pkg/typing_only.py": "",
        "pkg/unused.py": "",
        "pkg/main.py": "from pkg.sub import leaf\n\ndef f():\n    import pkg.lazy\n\nPATH = 'pkg.by_name'\n",
    }.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "_helper.py").write_text("import pkg.main\n")
    script = tmp_path / "stages" / "s.py"
    script.write_text("from _helper import x\n")
    files = {str(p.relative_to(tmp_path)) for p in stage_deps.closure(script, stage_deps.package_modules(src))}
    assert files == {
        "stages/s.py",
        "stages/_helper.py",
        "src/pkg/__init__.py",
        "src/pkg/main.py",
        "src/pkg/sub/__init__.py",
        "src/pkg/sub/leaf.py",
        "src/pkg/lazy.py",
        "src/pkg/by_name.py",
    }


def test_a_missing_or_extra_code_dep_is_named_with_its_stage(tmp_path: Path):
    text = (REPO / "dvc.yaml").read_text()
    edited = tmp_path / "dvc.yaml"
    edited.write_text(
        text.replace("      - src/eaglenest/stages/train/optimization.py\n", "", 1).replace(
            "      - src/eaglenest/stages/evaluate/vllm.py\n",
            "      - src/eaglenest/stages/evaluate/vllm.py\n      - src/eaglenest/commands/report.py\n",
            1,
        )
    )
    assert stage_deps.problems(edited) == [
        "stage train: dvc.yaml misses src/eaglenest/stages/train/optimization.py (the stage runs it)",
        "stage evaluate: dvc.yaml lists src/eaglenest/commands/report.py, which the stage does not run",
    ]


def test_a_stages_params_module_is_a_code_dep_of_that_stage_alone():
    """An edit to one stage's schema re-runs that stage alone: its params module (and the rest of its package) is
    in no other stage's code deps, and the shared params module is in those of the stages that import it."""
    deps = {stage: set(stage_deps.expected_code_deps(stage)) for stage in stage_deps.stage_names()}
    for stage in deps:
        module = f"src/eaglenest/stages/{stage}/params.py"
        assert (REPO / module).is_file(), f"stage {stage} has no params module {module}"
        assert [other for other in deps if module in deps[other]] == [stage], module
        package = f"src/eaglenest/stages/{stage}/"
        assert [other for other in deps if any(dep.startswith(package) for dep in deps[other])] == [stage], package
    # the shared module is every stage's (core.stage loads a stage's sections with it): an edit there re-runs all
    assert all("src/eaglenest/core/params.py" in deps[stage] for stage in deps)


def test_each_stage_declares_as_params_deps_the_sections_it_reads():
    """dvc.yaml's ``params:`` of a stage are the sections its StageParams reads (a view of another stage's section,
    as convert's of extract's storage settings: its keys), but ``cluster``, which changes where a stage runs, never
    what it makes."""
    import yaml

    from eaglenest.commands.params_file import SECTIONS, STAGE_PARAMS

    declared = {
        name: stage.get("params", [])
        for name, stage in yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"].items()
    }
    for stage in stage_deps.stage_names():
        importlib.import_module(f"eaglenest.stages.{stage}")
        assert sys.modules[f"eaglenest.stages.{stage}"].STAGE.params is STAGE_PARAMS.get(stage)
        expected = []
        for section, field in STAGE_PARAMS.get(stage).model_fields.items():
            if section == "cluster":
                continue
            whole = SECTIONS.get(section).model
            expected += (
                [section]
                if field.annotation is whole
                else [f"{section}.{key}" for key in field.annotation.model_fields]
            )
        assert sorted(declared[stage]) == sorted(expected), stage


def test_the_workers_scheduling_hint_names_test_files_that_read_a_shared_pipeline():
    """tests/fixtures/workers.py starts these files first among the readers; a renamed file would drop silently."""
    from tests.fixtures.workers import LONGEST_READERS, SHARED_FIXTURES

    for name in LONGEST_READERS:
        assert (REPO / name).is_file(), name
        assert any(fixture in (REPO / name).read_text() for fixture in SHARED_FIXTURES), name
