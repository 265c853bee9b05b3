"""Figures for pages as SVG that is byte for byte the same for the same measurements, so ``--check`` can compare
it like the other generated files: no date, a fixed id salt, text kept as text (searchable, and a test can read
the values on the bars), readable at a page's width."""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# A page shows an image at most this wide without scaling it down (px at a browser's 96 per inch).
MAX_WIDTH_PX = 1600
BLUE, ORANGE, GREEN = "#4c72b0", "#dd8452", "#55a868"


@contextmanager
def page_style() -> Iterator[None]:
    """Matplotlib settings for a page's figure, held inside this block only: the same process may draw others
    (``eaglenest report``) with the defaults."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import rc_context

    with rc_context({"svg.hashsalt": "eaglenest", "svg.fonttype": "none", "font.size": 9}):
        yield


def new_figure(width_in: float, height_in: float) -> Figure:
    """A Figure without pyplot (no global state, no display) at most MAX_WIDTH_PX wide."""
    from matplotlib.figure import Figure

    assert width_in * 96 <= MAX_WIDTH_PX, f"a page's figure of {width_in} in is wider than {MAX_WIDTH_PX} px"
    return Figure(figsize=(width_in, height_in))


def svg_text(fig: Figure, source: str | None = None) -> str:
    """The figure as SVG text; ``source`` is written into its metadata (``dc:source``) where given."""
    metadata = {"Date": None, "Creator": "eaglenest"}
    if source is not None:
        metadata["Source"] = source
    out = io.StringIO()
    fig.savefig(out, format="svg", metadata=metadata)
    return out.getvalue()


def label_bars(axes: Any) -> None:
    """Each bar's value above it, two decimals, kept as text."""
    for container in axes.containers:
        if hasattr(container, "datavalues"):
            axes.bar_label(container, fmt="%.2f", padding=2, fontsize=7)
