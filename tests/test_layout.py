"""The house's rules, read from the source: no import circles, no stage importing a later one, vLLM only
in its back-end modules. Every ``import`` counts, also those inside functions (a lazy import still ties
two modules together)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "eaglenest"
# Pipeline order; a module belongs to the stage its path starts with (helpers below every stage belong to none).
STAGES = {"verifier": 0, "prepare": 1, "conversations": 1, "self_instruct": 1, "regenerate": 1, "extract": 2,
          "convert": 3, "train": 4, "evaluate": 5}
VLLM_MODULES = {"eaglenest.core.vllm_support", "eaglenest.stages.extract.vllm", "eaglenest.stages.extract.vllm_connector",
                "eaglenest.stages.evaluate.vllm", "eaglenest.stages.prepare.regenerate.vllm"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(eaglenest modules ``path`` imports, other top-level packages it imports)."""
    internal, external = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from eaglenest.stages.extract import hf` imports the module eaglenest.stages.extract.hf
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                     for alias in node.names]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top == "eaglenest":
                internal.add(name)
            else:
                external.add(top)
    return {name for name in internal if name in modules}, external


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(path, modules)[0] - {name} for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the list of modules around it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def stage_of(module: str) -> int | None:
    parts = module.split(".")
    return STAGES.get(parts[1]) if len(parts) > 1 else None


def test_the_import_graph_has_no_circle():
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()) or [])


def test_the_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_stage_imports_a_later_stage():
    later = [(module, target) for module, targets in import_graph().items() for target in targets
             if stage_of(module) is not None and stage_of(target) is not None and stage_of(target) > stage_of(module)]
    assert later == []


def test_only_the_vllm_back_ends_import_vllm():
    modules = all_modules()
    importers = {name for name, path in modules.items() if "vllm" in imports_of(path, modules)[1]}
    assert importers <= VLLM_MODULES, importers - VLLM_MODULES


def test_back_ends_import_their_contract_not_their_dispatcher():
    for family in ("extract", "evaluate", "regenerate"):
        for name, targets in import_graph().items():
            if name.startswith(f"eaglenest.{family}."):
                assert f"eaglenest.{family}" not in targets, f"{name} imports its dispatcher eaglenest.{family}"
