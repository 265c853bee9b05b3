"""``eaglenest report``: a Markdown report of how revisions differ — metrics table and plots as images.

DVC's ``dvc plots diff`` writes HTML that loads Vega from a CDN, so it is blank offline and in many CI
viewers; this renders the same curves and bars with matplotlib to PNG files next to the Markdown.

Revisions are git revisions (branch, tag, commit), DVC experiment names (``dvc exp show`` lists them), or
``workspace``. Metrics are the JSON files dvc.yaml declares as metrics; curves are dvclive's TSV files and
the evaluate stage's tables, read at each revision with ``git show`` (they are committed: ``cache: false``).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import yaml

from eaglenest.core.atomic import atomic_write_bytes
from eaglenest.core.errors import EaglenestError

WORKSPACE = "workspace"
CURVES = {
    "train_loss": ("Training loss", ["dvclive/train/plots/metrics/train/loss.tsv"]),
    "val_accuracy": ("Validation accuracy per TTT step",
                     [f"dvclive/train/plots/metrics/val/acc_{i}.tsv" for i in range(8)]),
    "tau_sim": ("Simulated acceptance length (tau_sim)", ["dvclive/train/plots/metrics/val/tau_sim.tsv"]),
}
BARS = {
    "acceptance_per_position": ("Acceptance rate per draft position", "metrics/eval_plots/acceptance.json"),
    "tau_vs_baseline": ("Acceptance length tau against the n-gram baseline", "metrics/eval_plots/tau.json"),
}


class Revision:
    """Reads files of one revision of the repository (or the workspace)."""

    def __init__(self, repo: Path, rev: str) -> None:
        self.repo, self.rev = repo, rev
        self.ref = None if rev == WORKSPACE else self._resolve(rev)

    def _git(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], cwd=self.repo, capture_output=True, text=True)

    def _resolve(self, rev: str) -> str:
        if self._git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").returncode == 0:
            return rev
        refs = self._git("for-each-ref", "--format=%(refname)", "refs/exps").stdout.split()
        matches = [ref for ref in refs if ref.rsplit("/", 1)[-1] == rev]
        if len(matches) == 1:
            return matches[0]
        raise EaglenestError(f"revision {rev!r}: not a git revision, DVC experiment or 'workspace'")

    def read(self, path: str) -> str | None:
        if self.ref is None:
            file = self.repo / path
            return file.read_text() if file.is_file() else None
        shown = self._git("show", f"{self.ref}:{path}")
        return shown.stdout if shown.returncode == 0 else None


def flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    """Nested metrics as flat names: ``train.val_acc.0`` (lists get their index)."""
    if isinstance(value, dict):
        for key, item in value.items():
            flatten(f"{prefix}.{key}" if prefix else str(key), item, out)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            flatten(f"{prefix}.{i}", item, out)
    else:
        out[prefix] = value


def metric_files(repo: Path) -> list[str]:
    """The metrics files dvc.yaml declares, in stage order."""
    stages = yaml.safe_load((repo / "dvc.yaml").read_text()).get("stages", {})
    files = []
    for stage in stages.values():
        for entry in stage.get("metrics", []):
            files.append(next(iter(entry)) if isinstance(entry, dict) else entry)
    return files


def read_metrics(revision: Revision, files: list[str]) -> dict[str, Any]:
    metrics: dict[str, Any] = {}
    for path in files:
        text = revision.read(path)
        if text:
            flatten(Path(path).stem, json.loads(text), metrics)
    return metrics


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "—" if value is None else str(value)


def metrics_table(base: str, revisions: list[str], values: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown rows: metric, base value, each revision's value and its change; changed metrics first."""
    names = sorted({name for v in values.values() for name in v})
    header = ["metric", base, *[f"{rev} (change)" for rev in revisions]]
    changed, unchanged = [], []
    for name in names:
        base_value = values[base].get(name)
        cells, differs = [], False
        for rev in revisions:
            value = values[rev].get(name)
            differs |= value != base_value
            if isinstance(value, (int, float)) and isinstance(base_value, (int, float)) and value != base_value:
                cells.append(f"{_format(value)} ({value - base_value:+.4g})")
            else:
                cells.append(_format(value))
        (changed if differs else unchanged).append(f"| {name} | {_format(base_value)} | {' | '.join(cells)} |")
    rows = [f"| {' | '.join(header)} |", "|" + "---|" * len(header)]
    return rows + changed + unchanged


def _series(text: str) -> tuple[list[float], list[float]]:
    lines = text.splitlines()[1:]
    return [float(line.split("\t")[0]) for line in lines], [float(line.split("\t")[1]) for line in lines]


def render_plots(revisions: dict[str, Revision], out_dir: Path) -> list[tuple[str, str]]:
    """PNG files comparing the revisions; returns (title, file name) of each plot that had data."""
    import matplotlib

    matplotlib.use("Agg")  # no display, no network
    import matplotlib.pyplot as plt

    made = []
    for name, (title, paths) in CURVES.items():
        fig, ax = plt.subplots(figsize=(7, 4))
        plotted = False
        for rev, revision in revisions.items():
            for path in paths:
                text = revision.read(path)
                if text:
                    steps, values = _series(text)
                    label = rev if len(paths) == 1 else f"{rev}: {Path(path).stem}"
                    ax.plot(steps, values, marker="o", markersize=3, label=label)
                    plotted = True
        if plotted:
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            made.append((title, _save(fig, out_dir / f"{name}.png")))
        plt.close(fig)
    for name, (title, path) in BARS.items():
        fig, ax = plt.subplots(figsize=(7, 4))
        labels, heights = [], []
        for rev, revision in revisions.items():
            text = revision.read(path)
            for row in json.loads(text) if text else []:
                key = "position" if "position" in row else "drafter"
                value = row.get("acceptance", row.get("tau"))
                labels.append(f"{rev}\n{row.get('drafter', '')} {row[key] if key == 'position' else ''}".strip())
                heights.append(value)
        if heights:
            ax.bar(range(len(heights)), heights, color="tab:blue")
            ax.set_xticks(range(len(heights)), labels, fontsize=7, rotation=30, ha="right")
            ax.set_title(title)
            ax.grid(axis="y", alpha=0.3)
            fig.tight_layout()
            made.append((title, _save(fig, out_dir / f"{name}.png")))
        plt.close(fig)
    return made


def _save(fig: Any, path: Path) -> str:
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    atomic_write_bytes(path, buffer.getvalue())
    return path.name


def write_report(repo: Path, revisions: list[str], base: str, out_dir: Path) -> Path:
    """Writes ``out_dir/report.md`` and its PNG plots; returns the Markdown path."""
    if not revisions:
        revisions = [WORKSPACE]
    resolved = {rev: Revision(repo, rev) for rev in [base, *revisions]}
    files = metric_files(repo)
    values = {rev: read_metrics(revision, files) for rev, revision in resolved.items()}
    plots = render_plots(resolved, out_dir)
    lines = [f"# eaglenest report: {', '.join(revisions)} against {base}", "", "## Metrics", "",
             *metrics_table(base, revisions, values), "", "## Plots", ""]
    lines += [f"### {title}\n\n![{title}]({name})\n" for title, name in plots] or ["(no plot data)"]
    report = out_dir / "report.md"
    atomic_write_bytes(report, ("\n".join(lines) + "\n").encode())
    return report
