"""Writes data/conversations/python-functions.jsonl: code to complete from its signature and docstring.

    .venv/bin/python scripts/snapshot_python_functions.py [--count 600] [--out FILE]

Code completion from a docstring (what HumanEval sends) is traffic a chat-trained draft rarely sees. The
interpreter ships such code with itself: its standard library's source. Each record is one public function
that has a docstring, as an OpenAI-style conversation:

    {"messages": [{"role": "user", "content": "<the def line(s) and the docstring>"},
                  {"role": "assistant", "content": "<the function's body after the docstring>"}],
     "origin": "<module>.<function>"}

The user turn is the source text from ``def`` through the docstring, dedented; the reply is the rest of the
body, as written (``prepare.regenerate: true`` replaces it with the verifier's own completion). The file is
a snapshot, committed and a dependency of prepare: a new interpreter changes the pipeline only when this
script is run again and its output committed.

Functions are taken from every module except tests, demos and GUI toolkits, in module order, and ``--count``
of them evenly spaced in that order, so that the snapshot spreads over the library.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import sysconfig
import textwrap
from pathlib import Path

# Folders of the standard library whose code is not what users ask about (tests, demos, GUI, the old 2to3).
SKIPPED_PARTS = {
    "test",
    "tests",
    "idlelib",
    "tkinter",
    "turtledemo",
    "lib2to3",
    "site-packages",
    "__pycache__",
    "ensurepip",
    "venv",
    "pydoc_data",
    "encodings",
}
MAX_PROMPT_CHARS = 1200  # a docstring longer than this is reference documentation, not a task
MIN_BODY_LINES, MAX_BODY_LINES = 2, 40


def candidates(stdlib: Path) -> list[dict[str, object]]:
    """Every public top-level function with a docstring and a body of a task's size, in module order."""
    found = []
    for path in sorted(stdlib.rglob("*.py")):
        relative = path.relative_to(stdlib)
        if SKIPPED_PARTS & set(relative.parts) or relative.name.startswith("_"):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        module = ".".join(relative.with_suffix("").parts)
        for node in tree.body:
            record = _record(node, lines, module)
            if record is not None:
                found.append(record)
    return found


def _record(node: ast.AST, lines: list[str], module: str) -> dict[str, object] | None:
    """One function's conversation, or None where it is private, undocumented or of the wrong size."""
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.name.startswith("_"):
        return None
    if ast.get_docstring(node) is None or node.decorator_list:
        return None
    docstring = node.body[0]
    body = node.body[1:]
    if not body:
        return None
    start = node.lineno - 1  # the def line (decorators excluded above)
    prompt_end = docstring.end_lineno  # 1-based, inclusive: the docstring's last line
    body_end = node.end_lineno
    body_lines = lines[prompt_end:body_end]
    if not MIN_BODY_LINES <= len(body_lines) <= MAX_BODY_LINES:
        return None
    prompt = textwrap.dedent("\n".join(lines[start:prompt_end])) + "\n"
    reply = textwrap.dedent("\n".join(body_lines))
    if len(prompt) > MAX_PROMPT_CHARS or not reply.strip():
        return None
    return {
        "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}],
        "origin": f"{module}.{node.name}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=600)
    parser.add_argument("--out", type=Path, default=Path("data/conversations/python-functions.jsonl"))
    args = parser.parse_args()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    found = candidates(stdlib)
    if len(found) < args.count:
        sys.exit(f"--count {args.count}: the standard library at {stdlib} has only {len(found)} such functions")
    chosen = [found[i * len(found) // args.count] for i in range(args.count)]  # spread over the library
    tmp = args.out.with_suffix(".tmp")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "w", encoding="utf-8") as fh:
        for record in chosen:
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")
    tmp.replace(args.out)
    print(f"{args.out}: {len(chosen)} of {len(found)} functions of Python {sys.version.split()[0]}'s standard library")


if __name__ == "__main__":
    main()
