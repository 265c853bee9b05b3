"""docs/img/training.svg: the committed draft's training curves, and a check that they are still the draft's.

dvclive's ``dvclive/train`` is a DVC-cached output, not in git, so a fresh clone cannot redraw the figure. The
figure records in its metadata (``dc:source``) the md5 DVC computes for the folder it was drawn from; the check
compares that with the md5 ``dvc.lock`` records now, so a retrained draft with an old picture fails without the
cached data. Where the folder is in the workspace it is hashed as DVC hashes it and drawn only if it is the
locked one.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import yaml

from eaglenest.commands.generated.svg import BLUE, ORANGE, new_figure, page_style, svg_text
from eaglenest.commands.report.figures import tsv_series
from eaglenest.core.errors import InputFileError

TRAINING_SVG = "docs/img/training.svg"
CURVES_DIR = "dvclive/train"
PLOTS = "plots/metrics"
SOURCE = re.compile(r"<dc:source>dvclive/train md5 ([0-9a-f]{32}\.dir)")


def locked_md5(repo: Path, output: str = CURVES_DIR) -> str:
    """The md5 ``dvc.lock`` records for the output ``output``.

    Raises:
        InputFileError: dvc.lock is absent, not YAML, or records no such output.
    """
    path = repo / "dvc.lock"
    try:
        lock = yaml.safe_load(path.read_text())
    except (FileNotFoundError, yaml.YAMLError) as err:
        raise InputFileError(f"{path}: not readable as DVC's lock file ({type(err).__name__}); run dvc repro") from None
    stages = lock.get("stages") if isinstance(lock, dict) else None
    for stage in (stages or {}).values():
        for out in stage.get("outs") or [] if isinstance(stage, dict) else []:
            if isinstance(out, dict) and out.get("path") == output and isinstance(out.get("md5"), str):
                return out["md5"]
    raise InputFileError(f"{path}: no md5 of the output {output}; {TRAINING_SVG} is drawn from it (run dvc repro)")


def folder_md5(folder: Path) -> str:
    """The md5 DVC records for a folder output (``<hex>.dir``): dvc-data's tree of each file's md5."""
    from dvc_data.hashfile.hash_info import HashInfo
    from dvc_data.hashfile.meta import Meta
    from dvc_data.hashfile.tree import Tree

    tree = Tree()
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        tree.add(
            file.relative_to(folder).parts,
            Meta(size=file.stat().st_size),
            HashInfo("md5", hashlib.md5(file.read_bytes()).hexdigest()),
        )
    tree.digest()
    return str(tree.hash_info.value)


def drawn_md5(svg: str) -> str | None:
    """The md5 of the curves a training figure was drawn from, or None where it names none."""
    found = SOURCE.search(svg)
    return found.group(1) if found else None


def _curve(folder: Path, name: str) -> tuple[list[float], list[float]]:
    path = folder / PLOTS / f"{name}.tsv"
    try:
        return tsv_series(path.read_text())
    except FileNotFoundError:
        raise InputFileError(
            f"{path}: not found; {TRAINING_SVG} draws it (the train stage's dvclive curve {name})"
        ) from None


def training_figure_svg(folder: Path, md5: str) -> str:
    """The figure: training and validation loss, validation accuracy per TTT step, and tau_sim, against step."""
    steps = sorted(int(p.stem.removeprefix("acc_")) for p in (folder / PLOTS / "val").glob("acc_*.tsv"))
    if not steps:
        raise InputFileError(f"{folder / PLOTS / 'val'}: no acc_0.tsv; {TRAINING_SVG} draws the accuracy per TTT step")
    with page_style():
        fig = new_figure(9, 2.8)
        loss, accuracy, tau = fig.subplots(1, 3)
        loss.plot(*_curve(folder, "train/loss"), color=BLUE, linewidth=0.6, label="training")
        loss.plot(
            *_curve(folder, "val/loss"), color=ORANGE, linestyle="--", marker="o", markersize=3, label="validation"
        )
        values = [v for line in loss.get_lines() for v in line.get_ydata()]
        if min(values) > 0 and max(values) > 10 * min(values):
            loss.set_yscale("log")  # early losses are tens of times the late ones, which a linear axis flattens
        loss.set_title("loss")
        loss.legend(frameon=False)
        for step in steps:
            accuracy.plot(*_curve(folder, f"val/acc_{step}"), marker="o", markersize=3, label=f"TTT step {step}")
        accuracy.set_title("validation accuracy per TTT step")
        accuracy.set_ylim(0, 1)
        accuracy.legend(frameon=False)
        tau.plot(*_curve(folder, "val/tau_sim"), color=BLUE, marker="o", markersize=3)
        tau.set_title("tau_sim (validation)")
        for axes in (loss, accuracy, tau):
            axes.set_xlabel("step")
            axes.grid(alpha=0.3)
        fig.suptitle(f"{CURVES_DIR} (md5 {md5[:8]}, as dvc.lock records it)", fontsize=9)
        fig.tight_layout()
        return svg_text(fig, source=f"dvclive/train md5 {md5}")


def render_training_svg(old: str, repo: Path) -> str:
    """The figure drawn from the workspace's curves where they are the locked ones; the committed figure where
    they are not in the workspace and it was drawn from the locked ones.

    Raises:
        InputFileError: The workspace's curves are not the locked ones, or the figure is stale and the curves it
            needs are not in the workspace.
    """
    locked = locked_md5(repo)
    folder = repo / CURVES_DIR
    if folder.is_dir() and any(folder.iterdir()):
        found = folder_md5(folder)
        if found != locked:
            raise InputFileError(
                f"{folder}: md5 {found}, but dvc.lock records {locked}; `dvc checkout "
                f"{CURVES_DIR}` (or dvc repro) before drawing {TRAINING_SVG}"
            )
        return training_figure_svg(folder, locked)
    drawn = drawn_md5(old)
    if drawn == locked:
        return old
    raise InputFileError(
        f"{TRAINING_SVG} was drawn from {CURVES_DIR} md5 {drawn or '(none recorded)'}, but dvc.lock "
        f"records {locked}, and {CURVES_DIR} is not in the workspace: `dvc pull {CURVES_DIR}` (or "
        "dvc repro), then `eaglenest report --docs`"
    )
