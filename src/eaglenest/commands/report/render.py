"""The report as a document of blocks (headings, paragraphs, tables, images), written as Markdown with PNG files
next to it and as one HTML file that works offline: the images inlined as data URIs, no script, no stylesheet or
font fetched from anywhere.

Why PNG and not Vega: a Vega page works offline only with Vega's JavaScript inlined (about a megabyte per page) or
specs rendered by another dependency (``vl-convert-python``); the plots are matplotlib figures already, and a PNG
inlined as a data URI shows in any browser, mail client or CI artifact viewer with scripts off."""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.commands.report.comparison import NO_SPREAD, NO_VERDICT, RevisionComparison, SetComparison
from eaglenest.commands.report.figures import Plot
from eaglenest.commands.report.revisions import SEED_SPREAD
from eaglenest.core.atomic import atomic_write_bytes


@dataclass(frozen=True)
class Heading:
    """A heading of ``level`` (1 is the title)."""

    text: str
    level: int = 2


@dataclass(frozen=True)
class Paragraph:
    """Text; ``code`` spans are kept as Markdown writes them."""

    text: str


@dataclass(frozen=True)
class Table:
    """A table: its header cells and rows of cells."""

    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Image:
    """A plot: its title, the PNG file name next to report.md, and its bytes (inlined in the HTML)."""

    title: str
    file: str
    png: bytes


Block = Heading | Paragraph | Table | Image


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "—" if value is None else str(value)


def metrics_table(base: str, revisions: list[str], values: dict[str, dict[str, Any]]) -> Block:
    """Metric, base value, each revision's value and its change; changed metrics first."""
    names = sorted({name for v in values.values() for name in v})
    if not names:
        return Paragraph("(no declared metrics at these revisions)")
    changed, unchanged = [], []
    for name in names:
        base_value = values[base].get(name)
        cells, differs = [], False
        for rev in revisions:
            value = values[rev].get(name)
            differs |= value != base_value
            numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (value, base_value))
            if numeric and value != base_value:
                cells.append(f"{_format(value)} ({value - base_value:+.4g})")
            else:
                cells.append(_format(value))
        (changed if differs else unchanged).append((name, _format(base_value), *cells))
    return Table(("metric", base, *[f"{rev} (change)" for rev in revisions]), tuple(changed + unchanged))


def set_blocks(comparison: SetComparison, base_label: str, head_label: str) -> list[Block]:
    """One set: a line saying what was paired, then base, head, difference and verdict per figure."""
    blocks: list[Block] = [Heading(comparison.set_name, 3)]
    if comparison.refused:
        return [*blocks, Paragraph(comparison.refused)]
    rows = []
    for figure in comparison.figures:
        diff = figure.difference
        spread = NO_SPREAD if figure.spread is None else f"{figure.spread:.3g}"
        rows.append(
            (
                figure.name,
                f"{figure.base:.3f}",
                f"{figure.head:.3f}",
                f"{diff.value:+.3f} [{diff.low:+.3f}, {diff.high:+.3f}]",
                spread,
                figure.verdict,
            )
        )
    if not comparison.timed_pairs:
        rows.append(("speed-up", "—", "—", "no turn timed in both", "—", "—"))
    return [
        *blocks,
        Paragraph(
            f"{comparison.pairs} turns of {comparison.conversations} conversations paired; "
            f"{comparison.timed_pairs} of them timed in both."
        ),
        Table(("figure", base_label, head_label, "difference [95% interval]", "seed spread", "verdict"), tuple(rows)),
    ]


def comparison_blocks(comparison: RevisionComparison, samples: int, seed: int) -> list[Block]:
    """One head against base: how it was paired, then every headline set of either revision."""
    base, head = comparison.base, comparison.head
    blocks: list[Block] = [Heading(f"Paired comparison: {head} against {base}")]
    if comparison.same:
        return [*blocks, Paragraph(f"{head} and {base} are the same revision ({comparison.same}): nothing to compare.")]
    if comparison.missing:
        return [*blocks, Paragraph(f"Not paired: missing {', '.join(comparison.missing)}.")]
    other_backend = f"; {base}'s is {comparison.base_backend}" if comparison.base_backend != comparison.backend else ""
    blocks.append(
        Paragraph(
            f"Back end: {comparison.backend} (the headline back end of {head}{other_backend}). Each figure is "
            "recomputed on the turns both revisions decoded (same id and turn); the interval of the difference is a "
            f"paired bootstrap over conversations ({samples} resamples, seed {seed}). A change is better or worse "
            f"when that interval excludes zero and the change exceeds the seed-to-seed spread recorded in "
            f"{SEED_SPREAD} at "
            f"{comparison.spread_at}"
            + ("" if comparison.has_spreads else f" ({NO_SPREAD}: {NO_VERDICT} on any change)")
            + "."
        )
    )
    if comparison.other_host:
        hosts = "; ".join(f"{rev}: {key}" for rev, key in comparison.hosts)
        blocks.append(
            Paragraph(
                f"Host kinds differ ({hosts}): kernels differ by host kind, so the figures are shown "
                "and neither revision is called better or worse."
            )
        )
    for set_comparison in comparison.sets:
        blocks += set_blocks(set_comparison, base, head)
    return blocks


def plot_blocks(plots: list[Plot]) -> list[Block]:
    """Each plot under its heading, its caption below it."""
    blocks: list[Block] = [Heading("Plots")]
    for plot in plots:
        blocks += [Heading(plot.title, 3), Image(plot.title, f"{plot.stem}.png", plot.png())]
        blocks += [Paragraph(plot.caption)] if plot.caption else []
    if not plots:
        blocks.append(Paragraph("(no plot data at these revisions)"))
    return blocks


def _markdown_row(cells: tuple[str, ...]) -> str:
    return f"| {' | '.join(cells)} |"


def markdown(blocks: list[Block]) -> str:
    """The blocks as Markdown, images linked by file name."""
    lines: list[str] = []
    for block in blocks:
        if isinstance(block, Heading):
            lines.append(f"{'#' * block.level} {block.text}")
        elif isinstance(block, Paragraph):
            lines.append(block.text)
        elif isinstance(block, Table):
            lines += [
                _markdown_row(block.header),
                "|" + "---|" * len(block.header),
                *(_markdown_row(row) for row in block.rows),
            ]
        else:
            lines.append(f"![{block.title}]({block.file})")
        lines.append("")
    return "\n".join(lines)


def _inline(text: str) -> str:
    """Escaped text with Markdown's ``code`` spans as <code>."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


HTML_STYLE = (
    "body{font-family:sans-serif;max-width:1650px;margin:1em auto;padding:0 1em}"
    "table{border-collapse:collapse}td,th{border:1px solid #bbb;padding:2px 8px;text-align:left}"
    "img{max-width:100%}"
)


def html_document(blocks: list[Block], title: str) -> str:
    """The blocks as one HTML page with every image inlined: it needs nothing but itself to show."""
    body: list[str] = []
    for block in blocks:
        if isinstance(block, Heading):
            body.append(f"<h{block.level}>{_inline(block.text)}</h{block.level}>")
        elif isinstance(block, Paragraph):
            body.append(f"<p>{_inline(block.text)}</p>")
        elif isinstance(block, Table):
            head = "".join(f"<th>{_inline(cell)}</th>" for cell in block.header)
            rows = "".join(
                "<tr>" + "".join(f"<td>{_inline(cell)}</td>" for cell in row) + "</tr>" for row in block.rows
            )
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        else:
            data = base64.b64encode(block.png).decode("ascii")
            body.append(
                f'<figure><img alt="{html.escape(block.title)}" src="data:image/png;base64,{data}">'
                f"<figcaption>{_inline(block.title)}</figcaption></figure>"
            )
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{HTML_STYLE}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def write_documents(blocks: list[Block], title: str, out_dir: Path) -> tuple[Path, Path]:
    """Writes report.md with its PNG files and report.html (each atomically); returns the two documents' paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for block in blocks:
        if isinstance(block, Image):
            atomic_write_bytes(out_dir / block.file, block.png)
    report, page = out_dir / "report.md", out_dir / "report.html"
    atomic_write_bytes(report, markdown(blocks).encode())
    atomic_write_bytes(page, html_document(blocks, title).encode())
    return report, page
