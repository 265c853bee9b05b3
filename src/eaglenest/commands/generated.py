"""Generated files, and the README's figures: rendered from the committed metrics into marked blocks.

A :class:`Generated` file is rendered from its current text and the repository; :func:`stale` names the ones that
differ from what their generator writes now, and :func:`write` rewrites them atomically. README.md's headline
figure and its table of what the demo measures are rendered from ``metrics/eval.json`` and
``metrics/eval/details.json`` into blocks between HTML comment markers (``eaglenest report --readme``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.commands.summary import figure, read_json
from eaglenest.core.atomic import atomic_write_bytes
from eaglenest.core.errors import InputFileError

README_COMMAND = "eaglenest report --readme"
README_BLOCKS = ("headline", "demo-table")


def _headline_figures(repo: Path) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """The headline back end, ``metrics/eval.json`` and ``metrics/eval/details.json`` of ``repo``."""
    headline = read_json(repo / "metrics" / "eval.json")
    details = read_json(repo / "metrics" / "eval" / "details.json")
    backend = details.get("headline_backend")
    if backend not in ("hf", "vllm"):
        raise InputFileError(f"{repo / 'metrics/eval/details.json'}: no headline_backend; rerun evaluate")
    return backend, headline, details


def readme_blocks(repo: Path) -> dict[str, list[str]]:
    """The README's generated blocks: the headline sentence and the table of what the demo measures."""
    backend, headline, details = _headline_figures(repo)
    sets = {name: figures for name, figures in headline.items() if isinstance(figures, dict)}
    if not sets:
        raise InputFileError(f"{repo / 'metrics/eval.json'}: holds no evaluation set")
    runs = details.get("runs", {}).get(backend, {}).get("sets", {})
    k = details.get("num_speculative_tokens")
    first, figures = next(iter(sets.items()))
    sentence = (f"**`{first}`: τ {figure(figures, f'{backend}_tau')} tokens per verifier step at K = {k}, and "
                f"{figure(figures, f'{backend}_speedup', 'x')} single-stream speed-up over plain decoding** "
                f"({backend}, 95% intervals over prompts; n-gram drafting "
                f"{figure(figures, f'{backend}_ngram_speedup', 'x')}; lossless {headline.get('lossless')}).")
    table = [f"| set | prompts | timed turns | {backend} τ (95%) | speed-up (95%) | n-gram speed-up (95%) |",
             "|---|---|---|---|---|---|"]
    for name, values in sets.items():
        summary = runs.get(name, {}).get("summary", {})
        table.append(f"| `{name}` | {summary.get('num_prompts', '—')} | {summary.get('timed_turns', '—')} | "
                     f"{figure(values, f'{backend}_tau')} | {figure(values, f'{backend}_speedup', 'x')} | "
                     f"{figure(values, f'{backend}_ngram_speedup', 'x')} |")
    return {"headline": [sentence], "demo-table": table}


def _marker(name: str) -> tuple[str, str]:
    return (f"<!-- generated:{name} by `{README_COMMAND}` from metrics/; do not edit -->",
            f"<!-- /generated:{name} -->")


def render_readme(text: str, repo: Path, path: Path) -> str:
    """``text`` (a README) with every generated block rendered anew from ``repo``'s committed metrics."""
    blocks = readme_blocks(repo)
    for name in README_BLOCKS:
        begin, end = _marker(name)
        pattern = re.compile(re.escape(begin) + r"\n.*?" + re.escape(end), re.DOTALL)
        if len(pattern.findall(text)) != 1:
            raise InputFileError(f"{path}: needs exactly one block between {begin!r} and {end!r}")
        text = pattern.sub(lambda _match, name=name: "\n".join([_marker(name)[0], *blocks[name], _marker(name)[1]]),
                           text)
    return text


@dataclass(frozen=True)
class Generated:
    """One generated file: where it lives, how its text is made from the current one, what regenerates it."""

    path: str
    render: Callable[[str, Path], str]
    command: str


README_TARGET = Generated("README.md", lambda old, repo: render_readme(old, repo, repo / "README.md"), README_COMMAND)


def _current(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return ""


def _rendered(repo: Path, target: Generated) -> tuple[Path, str, str]:
    """``target``'s path, its current text and the text its generator writes now."""
    path = repo / target.path
    old = _current(path)
    return path, old, target.render(old, repo)


def stale(repo: Path, targets: tuple[Generated, ...]) -> list[str]:
    """One line per target whose committed text differs from what its generator writes now."""
    problems = []
    for target in targets:
        _, old, new = _rendered(repo, target)
        if new != old:
            problems.append(f"{target.path} is not what `{target.command}` writes from the current sources; "
                            f"run `{target.command}` and commit the result")
    return problems


def write(repo: Path, targets: tuple[Generated, ...]) -> list[str]:
    """Writes each target whose text changed (atomically); returns the paths written."""
    written = []
    for target in targets:
        path, old, new = _rendered(repo, target)
        if new != old:
            atomic_write_bytes(path, new.encode("utf-8"), fsync=False)
            written.append(target.path)
    return written


def regenerate(repo: Path, targets: tuple[Generated, ...], check: bool) -> int:
    """Writes ``targets`` (or with ``check`` only compares them); prints what it did; returns the exit status."""
    if check:
        problems = stale(repo, targets)
        print("\n".join(problems) if problems else f"up to date: {', '.join(t.path for t in targets)}")
        return 1 if problems else 0
    written = write(repo, targets)
    print("\n".join(f"wrote {path}" for path in written) if written else "nothing to write: all up to date")
    return 0
