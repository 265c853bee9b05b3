"""Generated files and generated blocks: text rendered from committed measurements, compared and rewritten.

A :class:`Generated` file is rendered from its current text and the repository; :func:`stale` names the ones that
differ from what their generator writes now, and :func:`write` rewrites them atomically (or removes one whose
measurements are gone). A page's generated block sits between two HTML comment markers that name the command
that rewrites it and where its figures come from; :func:`render_blocks` renders every block of a page anew.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from eaglenest.core.atomic import atomic_write_bytes
from eaglenest.core.errors import InputFileError


@dataclass(frozen=True)
class Generated:
    """One generated file: where it lives, how its text is made from the current one, what regenerates it.

    Attributes:
        path: The file, relative to the repository.
        render: (current text, repository) to the text its generator writes; None where the file must not exist
            (the measurement it draws is not committed).
        command: The command that rewrites it.
    """

    path: str
    render: Callable[[str, Path], str | None]
    command: str


def marker(name: str, command: str, source: str) -> tuple[str, str]:
    """The opening and closing comment of the generated block ``name``."""
    return (f"<!-- generated:{name} by `{command}` from {source}; do not edit -->", f"<!-- /generated:{name} -->")


def render_blocks(text: str, blocks: dict[str, list[str]], command: str, source: str, path: Path) -> str:
    """``text`` with each block of ``blocks`` (name to lines) rendered anew between its markers.

    A block whose opening marker is indented (inside a list item) gets that indent on every line.

    Raises:
        InputFileError: The page lacks a block's markers, or holds them more than once.
    """
    for name, lines in blocks.items():
        begin, end = marker(name, command, source)
        pattern = re.compile(
            r"^([ \t]*)" + re.escape(begin) + r"\n.*?^\1" + re.escape(end) + "$", re.DOTALL | re.MULTILINE
        )
        if len(pattern.findall(text)) != 1:
            raise InputFileError(f"{path}: needs exactly one block between {begin!r} and {end!r}")

        def block(match: re.Match[str], lines: list[str] = lines, begin: str = begin, end: str = end) -> str:
            indent = match.group(1)
            return "\n".join(f"{indent}{line}".rstrip() for line in [begin, *lines, end])

        text = pattern.sub(block, text)
    return text


def _current(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return ""


def _rendered(repo: Path, target: Generated) -> tuple[Path, str, str | None]:
    """``target``'s path, its current text and the text its generator writes now (None: no file)."""
    path = repo / target.path
    old = _current(path)
    return path, old, target.render(old, repo)


def stale(repo: Path, targets: tuple[Generated, ...]) -> list[str]:
    """One line per target whose committed text differs from what its generator writes now."""
    problems = []
    for target in targets:
        path, old, new = _rendered(repo, target)
        if new is None and path.exists():
            problems.append(
                f"{target.path} draws a measurement that is not committed; run `{target.command}` "
                "(it removes the file) and commit the result"
            )
        elif new is not None and new != old:
            problems.append(
                f"{target.path} is not what `{target.command}` writes from the current sources; "
                f"run `{target.command}` and commit the result"
            )
    return problems


def write(repo: Path, targets: tuple[Generated, ...]) -> list[str]:
    """Writes each target whose text changed (atomically), removes each that must not exist; returns what it did."""
    done = []
    for target in targets:
        path, old, new = _rendered(repo, target)
        if new is None:
            if path.exists():
                path.unlink()
                done.append(f"removed {target.path}")
        elif new != old:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, new.encode("utf-8"), fsync=False)
            done.append(f"wrote {target.path}")
    return done
