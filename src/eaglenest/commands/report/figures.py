"""The report's plots: acceptance per draft position (EAGLE-3 against n-gram), tau per category with its interval,
and the training curves, as matplotlib Figures (tests read their axes) saved as PNG.

DVC's ``dvc plots diff`` writes HTML that loads Vega from a CDN, so it is blank offline and in many CI viewers;
these plots are PNG files drawn with matplotlib, which the HTML report inlines. A figure of one panel per set
wraps its panels into rows, so it stays at most :data:`MAX_WIDTH_PX` wide however many sets there are.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eaglenest.commands.report.revisions import DETAILS, Revision

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TRAIN_LOSS = "dvclive/train/plots/metrics/train/loss.tsv"
VAL_LOSS = "dvclive/train/plots/metrics/val/loss.tsv"
CURVES = {
    "val_accuracy": (
        "Validation accuracy per TTT step",
        [f"dvclive/train/plots/metrics/val/acc_{i}.tsv" for i in range(8)],
    ),
    "tau_sim": ("Simulated acceptance length (tau_sim)", ["dvclive/train/plots/metrics/val/tau_sim.tsv"]),
}
DPI = 110
# A page or a pull request shows an image at most this wide without scaling it down (px at DPI).
MAX_WIDTH_PX = 1600


@dataclass(frozen=True)
class Plot:
    """One plot of the report.

    Attributes:
        title: Its heading.
        stem: Its file name without ``.png``.
        figure: The matplotlib figure.
        caption: A line under it, or empty.
    """

    title: str
    stem: str
    figure: Figure
    caption: str = ""

    def png(self) -> bytes:
        """The figure as PNG bytes at :data:`DPI`."""
        buffer = io.BytesIO()
        self.figure.savefig(buffer, format="png", dpi=DPI)
        return buffer.getvalue()


def _colors(count: int) -> list[Any]:
    from matplotlib import colormaps

    palette = colormaps["tab10"]
    return [palette(i % 10) for i in range(count)]


def _run_sets(details: Any, backend: str) -> dict[str, Any]:
    if not isinstance(details, dict):
        return {}
    run = (details.get("runs") or {}).get(backend)
    return (run.get("sets") or {}) if isinstance(run, dict) else {}


def panel_grid(count: int, width: float) -> tuple[int, int]:
    """(rows, columns) for ``count`` panels ``width`` inches wide: as many columns as fit in MAX_WIDTH_PX."""
    columns = max(1, min(count, int(MAX_WIDTH_PX // (width * DPI))))
    return math.ceil(count / columns), columns


def _panels(set_names: list[str], width: float = 4.6, height: float = 3.8) -> tuple[Figure, list[Any]]:
    from matplotlib.figure import Figure

    rows, columns = panel_grid(len(set_names), width)
    # a Figure without pyplot: no global state, no display, and savefig renders with Agg
    fig = Figure(figsize=(width * columns, height * rows), layout="constrained")
    axes = list(fig.subplots(rows, columns, squeeze=False).flat)
    for unused in axes[len(set_names) :]:
        fig.delaxes(unused)  # the last row's empty cells
    return fig, axes[: len(set_names)]


def _ordered_union(groups: list[list[str]]) -> list[str]:
    seen: list[str] = []
    for group in groups:
        seen += [name for name in group if name not in seen]
    return seen


def acceptance_figure(series: list[tuple[str, Any]], backend: str) -> Figure | None:
    """Acceptance rate per draft position, EAGLE-3 against n-gram per revision, one panel per set.

    Args:
        series: (label, details.json document) per distinct revision.
        backend: The back end whose sets are drawn.

    Returns:
        The figure, or None where no revision has acceptance figures for the back end.
    """
    sets = _ordered_union([list(_run_sets(details, backend)) for _, details in series])
    sets = [
        name
        for name in sets
        if any("per_position_acceptance" in _run_sets(d, backend).get(name, {}).get("summary", {}) for _, d in series)
    ]
    if not sets:
        return None
    fig, axes = _panels(sets)
    colors = _colors(len(series))
    bars = 2 * len(series)
    width = 0.8 / bars
    for ax, set_name in zip(axes, sets, strict=True):
        positions = 0
        for i, (label, details) in enumerate(series):
            summary = _run_sets(details, backend).get(set_name, {}).get("summary", {})
            for j, (drafter, key, style) in enumerate(
                (
                    ("EAGLE-3", "per_position_acceptance", {}),
                    ("n-gram", "ngram_per_position_acceptance", {"hatch": "//", "alpha": 0.45}),
                )
            ):
                rates = summary.get(key)
                if not rates:
                    continue
                positions = max(positions, len(rates))
                offset = (2 * i + j - (bars - 1) / 2) * width
                ax.bar(
                    [p + 1 + offset for p in range(len(rates))],
                    rates,
                    width,
                    color=colors[i],
                    edgecolor=colors[i],
                    label=f"{label}: {drafter}",
                    **style,
                )
        ax.set_xticks(range(1, positions + 1))
        ax.set_ylim(0, 1)
        _label_panel(ax, f"{set_name} ({backend})", "draft position", "acceptance rate")
    fig.suptitle("Acceptance rate per draft position: EAGLE-3 against n-gram")
    return fig


def _label_panel(ax: Any, title: str, xlabel: str, ylabel: str) -> None:
    """A bar panel's title, axis labels, grid and legend, the same on every panel."""
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)


def tau_category_figure(series: list[tuple[str, Any]], backend: str) -> Figure | None:
    """tau per category with its 95% interval as error bars, one panel per set, the K+1 bound drawn.

    The first group of each panel (``all``) is the set's tau, so a set without categories still gets a panel.

    Args:
        series: (label, details.json document) per distinct revision.
        backend: The back end whose sets are drawn.

    Returns:
        The figure, or None where no revision has a tau for the back end.
    """
    sets = [
        name
        for name in _ordered_union([list(_run_sets(d, backend)) for _, d in series])
        if any("tau" in _run_sets(d, backend).get(name, {}).get("summary", {}) for _, d in series)
    ]
    if not sets:
        return None
    bounds = sorted(
        {
            details["num_speculative_tokens"] + 1
            for _, details in series
            if isinstance(details, dict) and isinstance(details.get("num_speculative_tokens"), int)
        }
    )
    fig, axes = _panels(sets, width=4.8)
    colors = _colors(len(series))
    width = 0.8 / len(series)
    for ax, set_name in zip(axes, sets, strict=True):
        summaries = [_run_sets(d, backend).get(set_name, {}).get("summary", {}) for _, d in series]
        categories = ["all", *_ordered_union([list(s.get("categories", {})) for s in summaries])]
        for i, ((label, _), summary) in enumerate(zip(series, summaries, strict=True)):
            figures = {"all": summary.get("tau"), **summary.get("categories", {})}
            xs, values, low, high = [], [], [], []
            for x, category in enumerate(categories):
                figure = figures.get(category)
                if figure:
                    xs.append(x + (i - (len(series) - 1) / 2) * width)
                    values.append(figure["value"])
                    low.append(figure["value"] - figure["low"])
                    high.append(figure["high"] - figure["value"])
            ax.bar(xs, values, width, yerr=[low, high], capsize=3, color=colors[i], label=label)
        for bound in bounds:
            ax.axhline(bound, color="black", linestyle="--", linewidth=1, label=f"K+1 = {bound} (every draft accepted)")
        ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right", fontsize=8)
        if bounds:
            ax.set_ylim(0, max(bounds) * 1.08)
        _label_panel(ax, f"{set_name} ({backend})", "category", "tau (tokens per verify step)")
    fig.suptitle("tau per category with its 95% interval")
    return fig


def tsv_series(text: str) -> tuple[list[float], list[float]]:
    """A dvclive TSV's steps and values (the column after ``step``, ignoring a ``timestamp`` column)."""
    lines = [line.split("\t") for line in text.splitlines() if line.strip()]
    header, rows = lines[0], lines[1:]
    step = header.index("step") if "step" in header else 0
    value = next(i for i in range(len(header) - 1, -1, -1) if header[i] not in ("step", "timestamp"))
    return [float(row[step]) for row in rows], [float(row[value]) for row in rows]


def loss_figure(series: list[tuple[str, str | None, str | None]]) -> Figure | None:
    """Training loss (solid) against validation loss (dashed, markers) over steps, one colour per revision.

    Args:
        series: (label, train loss TSV text, validation loss TSV text) per distinct revision; None where absent.

    Returns:
        The figure, or None where no revision has a loss curve.
    """
    if not any(train or val for _, train, val in series):
        return None
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    for color, (label, train, val) in zip(_colors(len(series)), series, strict=True):
        if train:
            ax.plot(*tsv_series(train), color=color, linewidth=1, label=f"{label}: training")
        if val:
            ax.plot(
                *tsv_series(val), color=color, linestyle="--", marker="o", markersize=3, label=f"{label}: validation"
            )
    values = [v for line in ax.get_lines() for v in line.get_ydata()]
    if values and min(values) > 0 and max(values) > 10 * min(values):
        ax.set_yscale("log")  # early losses are tens of times the late ones, which a linear axis flattens
    ax.set_title("Training against validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def curve_figure(title: str, series: list[tuple[str, list[tuple[str, str]]]]) -> Figure | None:
    """dvclive curves over steps: per revision, (curve name, TSV text) pairs; None where none has data."""
    if not any(curves for _, curves in series):
        return None
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    several = max(len(curves) for _, curves in series) > 1
    for label, curves in series:
        for name, text in curves:
            ax.plot(*tsv_series(text), marker="o", markersize=3, label=f"{label}: {name}" if several else label)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def build_figures(series: list[tuple[str, Revision]]) -> list[Plot]:
    """Each plot that has data at the distinct revisions ``series`` ((label, revision) pairs)."""
    details = [(label, revision.read_json(DETAILS)) for label, revision in series]
    backends = _ordered_union(
        [
            [d["headline_backend"]]
            for _, d in details
            if isinstance(d, dict) and isinstance(d.get("headline_backend"), str)
        ]
    )
    backend = backends[0] if backends else "vllm"
    # vLLM counts n-gram acceptance only over the steps where the prompt lookup proposed: say so under the plot
    ngram_note = (
        "The n-gram rates are vLLM's own, over the steps where its prompt lookup proposed (conditional "
        "on a match); compare the two drafters by speed-up."
        if backend == "vllm"
        else ""
    )
    built = [
        ("Acceptance rate per draft position", "acceptance", acceptance_figure(details, backend), ngram_note),
        ("tau per category", "tau_per_category", tau_category_figure(details, backend), ""),
        (
            "Training against validation loss",
            "loss",
            loss_figure([(label, revision.read(TRAIN_LOSS), revision.read(VAL_LOSS)) for label, revision in series]),
            "",
        ),
    ]
    for name, (title, paths) in CURVES.items():
        curves = [
            (label, [(Path(p).stem, text) for p in paths if (text := revision.read(p))]) for label, revision in series
        ]
        built.append((title, name, curve_figure(title, curves), ""))
    return [Plot(title, stem, fig, caption) for title, stem, fig, caption in built if fig is not None]
