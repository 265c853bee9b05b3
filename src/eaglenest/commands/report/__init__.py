"""``eaglenest report BASE [HEAD ...]``: how revisions differ, as Markdown with PNG plots next to it and as one
HTML file that works offline.

The report has three parts:

* the headline table: every metric of the metrics files dvc.yaml declares, base against each head;
* the paired comparison, per headline set (:mod:`eaglenest.commands.report.comparison`): tau and the single-stream
  speed-up on the turns both revisions decoded, the paired interval of the difference, and a verdict against the
  recorded seed spread;
* plots (:mod:`eaglenest.commands.report.figures`): acceptance per draft position (EAGLE-3 against n-gram), tau per
  category with its interval, and the training curves.

Revisions are git revisions (branch, tag, commit), DVC experiment names (``dvc exp show`` lists them), or
``workspace`` (:mod:`eaglenest.commands.report.revisions`). :mod:`eaglenest.commands.report.render` writes the
document as Markdown and HTML.
"""

from __future__ import annotations

from pathlib import Path

from eaglenest.commands.report.comparison import (
    DEFAULT_SAMPLES,
    DEFAULT_SEED,
    MIN_SAMPLES,
    NO_SPREAD,
    NO_VERDICT,
    OTHER_HOST,
    PairedFigure,
    RevisionComparison,
    SetComparison,
    compare_revisions,
    compare_set,
    verdict,
)
from eaglenest.commands.report.figures import (
    MAX_WIDTH_PX,
    Plot,
    acceptance_figure,
    build_figures,
    loss_figure,
    tau_category_figure,
)
from eaglenest.commands.report.render import (
    Block,
    Heading,
    Paragraph,
    comparison_blocks,
    metrics_table,
    plot_blocks,
    write_documents,
)
from eaglenest.commands.report.revisions import (
    DETAILS,
    EVAL_METRICS,
    WORKSPACE,
    Revision,
    distinct_revisions,
    load_seed_spread,
    metric_files,
    read_metrics,
)
from eaglenest.core.errors import EaglenestError

__all__ = [
    "DETAILS",
    "EVAL_METRICS",
    "MAX_WIDTH_PX",
    "NO_SPREAD",
    "NO_VERDICT",
    "OTHER_HOST",
    "WORKSPACE",
    "PairedFigure",
    "Plot",
    "Revision",
    "RevisionComparison",
    "SetComparison",
    "acceptance_figure",
    "build_figures",
    "compare_revisions",
    "compare_set",
    "distinct_revisions",
    "load_seed_spread",
    "loss_figure",
    "tau_category_figure",
    "verdict",
    "write_report",
]


def write_report(
    repo: Path, revisions: list[str], base: str, out_dir: Path, samples: int = DEFAULT_SAMPLES, seed: int = DEFAULT_SEED
) -> Path:
    """Writes ``out_dir/report.md`` with its PNG plots, and ``out_dir/report.html``; returns the Markdown path.

    Args:
        repo: The repository.
        revisions: The head revisions; empty means the workspace.
        base: The revision they are compared against.
        out_dir: Where report.md, report.html and the PNG files go.
        samples: Bootstrap resamples of the paired comparison.
        seed: Seed of the resampling.

    Raises:
        EaglenestError: A revision does not exist, too few samples, or an input file is malformed.
    """
    if samples < MIN_SAMPLES:
        raise EaglenestError(f"bootstrap samples must be at least {MIN_SAMPLES} (got {samples})")
    heads = revisions or [WORKSPACE]
    base_revision = Revision(repo, base)
    head_revisions = [Revision(repo, rev) for rev in heads]
    everything = [base_revision, *head_revisions]
    by_name = {revision.rev: revision for revision in everything}
    files = metric_files(everything)
    values = {name: read_metrics(revision, files) for name, revision in by_name.items()}
    series = distinct_revisions(everything)

    title = f"eaglenest report: {', '.join(heads)} against {base}"
    blocks: list[Block] = [Heading(title, 1)]
    for label, revision in series:
        if " = " in label:
            blocks.append(
                Paragraph(
                    f"{label.replace(' = ', ' and ')} are the same revision ({revision.short}): "
                    "each plot draws it once."
                )
            )
    blocks += [Heading("Headline metrics"), metrics_table(base, heads, values)]
    for head in head_revisions:
        blocks += comparison_blocks(compare_revisions(base_revision, head, samples, seed), samples, seed)
    blocks += plot_blocks(build_figures(series))
    return write_documents(blocks, title, out_dir)[0]
