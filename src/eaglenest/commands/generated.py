"""Generated files, and the README's figures: rendered from the committed metrics into marked blocks.

A :class:`Generated` file is rendered from its current text and the repository; :func:`stale` names the ones that
differ from what their generator writes now, and :func:`write` rewrites them atomically. README.md's headline
figure and its table of what the demo measures are rendered from ``metrics/eval.json`` and
``metrics/eval/details.json`` into blocks between HTML comment markers (``eaglenest report --readme``), and the
figure the README shows, ``docs/img/headline.svg`` (τ and the speed-ups per headline set, draft against n-gram,
with their intervals), from the same files.
"""

from __future__ import annotations

import io
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


def _host(details: dict[str, Any]) -> str:
    """", on <the host kind>" where the evaluation recorded it."""
    host = details.get("host")
    return f", on {host['key']}" if isinstance(host, dict) and host.get("key") else ""


def _fraction(summary: dict[str, Any], key: str) -> str:
    value = summary.get(key)
    return f"{value:.3f}" if isinstance(value, int | float) else "—"


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
                f"{figure(figures, f'{backend}_ngram_speedup', 'x')}; lossless fraction {headline.get('lossless')}, "
                f"{details.get('runs', {}).get(backend, {}).get('dtype', '—')}{_host(details)}).")
    table = [f"| set | prompts | timed turns | {backend} τ (95%) | speed-up (95%) | n-gram speed-up (95%) | "
             "lossless | identical to plain |",
             "|---|---|---|---|---|---|---|---|"]
    for name, values in sets.items():
        summary = runs.get(name, {}).get("summary", {})
        # lossless: every turn equal to plain decoding under the set's rule (exact, or a flipped near-tie below
        # float32); identical: the turns equal token for token
        table.append(f"| `{name}` | {summary.get('num_prompts', '—')} | {summary.get('timed_turns', '—')} | "
                     f"{figure(values, f'{backend}_tau')} | {figure(values, f'{backend}_speedup', 'x')} | "
                     f"{figure(values, f'{backend}_ngram_speedup', 'x')} | {_fraction(summary, 'lossless_fraction')} "
                     f"| {_fraction(summary, 'identical_fraction')} |")
    return {"headline": [sentence], "demo-table": table}


HEADLINE_SVG = "docs/img/headline.svg"


def _with_interval(figures: dict[str, Any], key: str, where: str) -> tuple[float, float]:
    """``figures[key]`` and its 95% half-width; one line naming the file and the key where either is missing."""
    value, half = figures.get(key), figures.get(f"{key}_ci95")
    if not isinstance(value, int | float) or not isinstance(half, int | float):
        raise InputFileError(f"{where}: no {key} with {key}_ci95; the figure {HEADLINE_SVG} needs both (rerun "
                             "evaluate with vllm among its back ends)")
    return float(value), float(half)


def headline_svg(repo: Path) -> str:
    """The README's figure as SVG text: per headline set, τ (left) and the single-stream speed-up of the draft and of
    n-gram drafting (right), each with its 95% interval. Byte for byte the same for the same metrics (no date, a
    fixed id salt, text kept as text), so that ``--check`` can compare it like the other generated files."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import rc_context
    from matplotlib.figure import Figure

    backend, headline, details = _headline_figures(repo)
    where = str(repo / "metrics" / "eval.json")
    sets = [name for name, figures in headline.items() if isinstance(figures, dict)]
    if not sets:
        raise InputFileError(f"{where}: holds no evaluation set")
    tau = [_with_interval(headline[name], f"{backend}_tau", where) for name in sets]
    draft = [_with_interval(headline[name], f"{backend}_speedup", where) for name in sets]
    ngram = [_with_interval(headline[name], f"{backend}_ngram_speedup", where) for name in sets]
    # The settings hold for this figure only: the process may draw others (eaglenest report) with the defaults.
    with rc_context({"svg.hashsalt": "eaglenest", "svg.fonttype": "none", "font.size": 9}):
        fig = Figure(figsize=(8, 2.8))  # 576 x 202 pt: readable at a page's width
        left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2, 3]})
        positions = range(len(sets))
        left.bar(positions, [v for v, _ in tau], yerr=[h for _, h in tau], capsize=3, color="#4c72b0")
        left.set_ylim(1.0, max(v + h for v, h in tau) * 1.08)
        left.set_title(f"τ, tokens per verifier step (K = {details.get('num_speculative_tokens')})")
        width = 0.38
        for offset, values, label, colour in ((-width / 2, draft, "the draft", "#4c72b0"),
                                              (width / 2, ngram, "vLLM n-gram", "#dd8452")):
            right.bar([p + offset for p in positions], [v for v, _ in values], width, yerr=[h for _, h in values],
                      capsize=3, color=colour, label=label)
        right.axhline(1.0, color="black", linewidth=0.8)
        speedups = draft + ngram
        right.set_ylim(min(0.8, min(v - h for v, h in speedups) - 0.05), max(v + h for v, h in speedups) + 0.1)
        right.set_title("single-stream speed-up over plain decoding")
        right.legend(loc="upper right", frameon=False)
        for axes in (left, right):
            axes.set_xticks(list(positions), sets)
            for value_label in axes.containers:
                if hasattr(value_label, "datavalues"):
                    axes.bar_label(value_label, fmt="%.2f", padding=2, fontsize=7)
        fig.suptitle(f"metrics/eval.json ({backend}; bars: 95% intervals over prompts)", fontsize=9)
        fig.tight_layout()
        out = io.StringIO()
        fig.savefig(out, format="svg", metadata={"Date": None, "Creator": "eaglenest"})
    return out.getvalue()


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
HEADLINE_SVG_TARGET = Generated(HEADLINE_SVG, lambda _old, repo: headline_svg(repo), README_COMMAND)
# What `eaglenest report --readme` writes from the committed metrics.
README_TARGETS = (README_TARGET, HEADLINE_SVG_TARGET)


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
            path.parent.mkdir(parents=True, exist_ok=True)
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
