"""A traffic mix the demo's draft was not trained for (run by hand): code-review requests over functions of installed
third-party packages, for the served-traffic loop of docs/traffic.md.

    .venv/bin/python bench/traffic_mix.py [--count 300] [--out bench/prompts/code-review.jsonl]

Each request pastes one function (5 to 25 lines, at most 1,200 characters) of yaml, click, jinja2, rich, pygments,
markdown_it, tomlkit or packaging, as installed, under one of a few phrasings a user would use to ask for a review.
None of it is in a built-in source: builtin:python-functions holds the standard library's functions, to complete
from a signature and docstring, never to review; a review is prose about code, a reply the default mix never trains
on. The functions are picked by a seeded draw over the packages' files in sorted order, so a checkout with the same
package versions writes the same file (the committed one is what docs/experiments.md measured).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import random
import textwrap
from pathlib import Path

PACKAGES = ("yaml", "click", "jinja2", "rich", "pygments", "markdown_it", "tomlkit", "packaging")
ASKS = (
    "Can you review this Python function and point out any bugs or edge cases?",
    "I wrote this function for a project. What would you change to make it cleaner?",
    "Please do a code review of the following function. Is it correct and readable?",
    "Is there anything wrong with this code? Explain what it does and what could break.",
    "Review this function like a senior engineer would in a pull request.",
    "What are the weak spots in this function, and how would you test it?",
)
MIN_LINES, MAX_LINES, MAX_CHARS = 5, 25, 1200


def functions(package: str) -> list[str]:
    """The source of every top-level or method function of one installed package that fits the size limits."""
    root = Path(importlib.import_module(package).__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                text = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
                if text and MIN_LINES <= text.count("\n") + 1 <= MAX_LINES and len(text) <= MAX_CHARS:
                    found.append(text)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/prompts/code-review.jsonl"))
    args = parser.parse_args()
    pool = sorted({text for package in PACKAGES for text in functions(package)})
    rng = random.Random(args.seed)
    picked = rng.sample(pool, args.count)
    lines = [
        json.dumps({"prompt": f"{rng.choice(ASKS)}\n\n```python\n{text}\n```", "kind": "code-review"})
        for text in picked
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"{args.count} code-review requests from {len(pool)} functions -> {args.out}")


if __name__ == "__main__":
    main()
