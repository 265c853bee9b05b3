"""``eaglenest report``'s declaration; the report itself (:mod:`eaglenest.commands.report`) imports numpy and
yaml at its top, so it is imported only when the command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from eaglenest.commands.command import Command
from eaglenest.core.errors import EaglenestError


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "base",
        metavar="BASE",
        nargs="?",
        help="the revision to compare against: a git revision, a DVC experiment name or 'workspace'",
    )
    parser.add_argument(
        "heads", metavar="HEAD", nargs="*", help="the revisions compared with BASE, same kinds (default: workspace)"
    )
    parser.add_argument("--out", default="report", help="output folder (report.md, report.html and PNG plots)")
    parser.add_argument("--repo", default=".", help="the repository (default: the current folder)")
    parser.add_argument(
        "--samples",
        type=int,
        default=2000,
        help="bootstrap resamples of the paired comparison (default: 2000, as evaluate's)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the resampling (default: 0, as evaluate's)")
    parser.add_argument(
        "--readme",
        action="store_true",
        help="instead of a report, render README.md's headline "
        "figure and demo table from the workspace's metrics/eval.json",
    )
    parser.add_argument(
        "--docs",
        action="store_true",
        help="instead of a report, render every figure of README.md "
        "and docs/ that comes from a committed measurement (blocks and docs/img/*.svg)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="with --readme or --docs: write nothing, exit 1 if a figure differs from its measurements",
    )


def _run(args: argparse.Namespace) -> int:
    if args.readme or args.docs:
        from eaglenest.commands.generated import DOCS_TARGETS, README_TARGETS, regenerate

        flag = "--docs" if args.docs else "--readme"
        if args.heads or args.base:
            raise EaglenestError(f"{flag} takes no revisions: it renders the workspace's committed measurements")
        return regenerate(Path(args.repo), DOCS_TARGETS if args.docs else README_TARGETS, args.check)
    if args.base is None:
        raise EaglenestError("give BASE, the revision to compare against (or --readme, --docs)")
    from eaglenest.commands.report import write_report

    report = write_report(Path(args.repo), args.heads, args.base, Path(args.out), args.samples, args.seed)
    print(f"{report}\n{report.with_suffix('.html')}")
    return 0


COMMAND = Command(
    "report",
    help="Markdown and offline HTML report of revisions against a base: headline metrics, a paired "
    "comparison of the evaluation records, and plots as PNG images",
    add_arguments=_add_arguments,
    run=_run,
)
