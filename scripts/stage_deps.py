"""Each stage's code dependencies, computed from the source: what dvc.yaml must list, and nothing else.

A stage's code is its script ``stages/<name>.py`` and every file Python runs for it: the modules it imports,
directly or through others, their parent packages' ``__init__.py``, the script's own helpers beside it
(``stages/_guard.py``), imports inside functions (lazy imports run too), and modules named by a string
constant equal to a module's dotted name (vLLM loads the extract stage's connector by name). Imports under
``if TYPE_CHECKING:`` never run and do not count.

    .venv/bin/python scripts/stage_deps.py           # check dvc.yaml: one line per missing or extra file
    .venv/bin/python scripts/stage_deps.py --write   # rewrite each stage's code deps in dvc.yaml

Standard library only; the layout test imports it.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
SCRIPTS = ROOT / "stages"
CODE_PREFIXES = ("stages/", "src/")


def package_modules(src: Path = SRC) -> dict[str, Path]:
    """Dotted module name -> file, for every module under ``src``."""
    modules = {}
    for path in sorted(src.rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (their ``else:`` branch does run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def imported_names(path: Path, module: str | None, own_packages: frozenset[str] = frozenset()) -> set[str]:
    """Dotted names ``path`` imports at run time (absolute, relative resolved against ``module``), plus string
    constants that name a module of ``own_packages`` (dotted, starting with one of them)."""
    names: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                if module is None:
                    continue
                package = _package_of(module, path).split(".")
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and re.fullmatch(r"[a-z_]+(\.[a-z_0-9]+)+", node.value)
            and node.value.split(".")[0] in own_packages
        ):
            names.add(node.value)
    return names


def with_parents(name: str) -> list[str]:
    """``a.b.c`` -> ``a``, ``a.b``, ``a.b.c``: importing a module runs its parent packages first."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def closure(script: Path, modules: dict[str, Path] | None = None) -> set[Path]:
    """Every file Python runs for the stage script ``script`` (the script included)."""
    modules = package_modules() if modules is None else modules
    own = frozenset(name.split(".")[0] for name in modules)
    files: set[Path] = set()
    todo: list[tuple[Path, str | None]] = [(script, None)]
    while todo:
        path, module = todo.pop()
        if path in files:
            continue
        files.add(path)
        for name in imported_names(path, module, own):
            sibling = script.parent / f"{name}.py"  # the script's own helpers (stages/_guard.py)
            if module is None and "." not in name and sibling.is_file():
                todo.append((sibling, None))
                continue
            for candidate in with_parents(name):
                if candidate in modules:
                    todo.append((modules[candidate], candidate))
    return files


def stage_names(dvc_yaml: Path = ROOT / "dvc.yaml") -> list[str]:
    """The stages dvc.yaml declares, in order (read without a YAML library: two-space keys under ``stages:``)."""
    names, inside = [], False
    for line in dvc_yaml.read_text().splitlines():
        if line.startswith("stages:"):
            inside = True
        elif inside and re.match(r"^\S", line):
            break
        elif inside and (match := re.match(r"^  ([\w-]+):\s*$", line)):
            names.append(match.group(1))
    return names


def expected_code_deps(stage: str) -> list[str]:
    """The code deps dvc.yaml must list for ``stage``, as repository-relative paths, sorted."""
    files = closure(SCRIPTS / f"{stage}.py")
    return sorted(str(path.relative_to(ROOT)) for path in files)


def _deps_block(lines: list[str], stage: str) -> tuple[int, int]:
    """(first, end) line indices of ``stage``'s ``deps:`` list items in dvc.yaml's lines."""
    start = lines.index(f"  {stage}:")
    deps = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == "deps:")
    end = deps + 1
    while end < len(lines) and lines[end].startswith("      "):
        end += 1
    return deps + 1, end


def listed_deps(stage: str, dvc_yaml: Path = ROOT / "dvc.yaml") -> list[str]:
    """The deps dvc.yaml lists for ``stage``, in order."""
    lines = dvc_yaml.read_text().splitlines()
    first, end = _deps_block(lines, stage)
    return [line.strip().removeprefix("- ").strip() for line in lines[first:end] if line.strip().startswith("- ")]


def problems(dvc_yaml: Path = ROOT / "dvc.yaml") -> list[str]:
    """One line per code file a stage's deps miss or list without running it."""
    found = []
    for stage in stage_names(dvc_yaml):
        listed = {dep for dep in listed_deps(stage, dvc_yaml) if dep.startswith(CODE_PREFIXES)}
        expected = set(expected_code_deps(stage))
        found += [f"stage {stage}: dvc.yaml misses {dep} (the stage runs it)" for dep in sorted(expected - listed)]
        found += [
            f"stage {stage}: dvc.yaml lists {dep}, which the stage does not run" for dep in sorted(listed - expected)
        ]
    return found


def write(dvc_yaml: Path = ROOT / "dvc.yaml") -> None:
    """Rewrites each stage's code deps in dvc.yaml (its other deps stay, after the code, in their order)."""
    lines = dvc_yaml.read_text().splitlines()
    for stage in stage_names(dvc_yaml):
        first, end = _deps_block(lines, stage)
        others = [line for line in lines[first:end] if not line.strip().removeprefix("- ").startswith(CODE_PREFIXES)]
        lines[first:end] = [f"      - {dep}" for dep in expected_code_deps(stage)] + others
    dvc_yaml.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="rewrite the code deps in dvc.yaml")
    args = parser.parse_args()
    if args.write:
        write()
    found = problems()
    for line in found:
        print(line, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
