"""Generated files: every figure of README.md and docs/ that comes from a committed measurement, rendered from it.

* README.md's headline and its table of what the demo measures, ``docs/img/headline.svg`` and docs/defaults.md's
  sentence on the committed τ, from ``metrics/eval.json`` and ``metrics/eval/details.json``
  (:mod:`~eaglenest.commands.generated.headline`);
* docs/serving.md's table of the served draft under load, the README headline's speed-ups at each concurrency and
  ``docs/img/concurrency.svg``, from ``bench/results/serve_concurrency.json``
  (:mod:`~eaglenest.commands.generated.concurrency`);
* ``docs/img/training.svg``, from the train stage's dvclive curves, checked against ``dvc.lock``
  (:mod:`~eaglenest.commands.generated.training`).

``eaglenest report --readme`` writes the README's; ``eaglenest report --docs`` (``make figures``) and
``python scripts/gen_reference.py`` write them all from the workspace; ``--check`` compares without writing, against
the committed run where the workspace holds another (:mod:`~eaglenest.commands.generated.committed`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from eaglenest.commands.generated.blocks import Generated, render_blocks, stale, write
from eaglenest.commands.generated.committed import check, regenerate
from eaglenest.commands.generated.concurrency import (
    CONCURRENCY_SVG,
    SERVE_RECORD,
    concurrency_svg,
    load_serve_record,
    serving_lines,
)
from eaglenest.commands.generated.headline import (
    HEADLINE_SVG,
    METRICS_SOURCE,
    README_COMMAND,
    committed_tau_lines,
    headline_svg,
    readme_blocks,
)
from eaglenest.commands.generated.training import TRAINING_SVG, render_training_svg

DOCS_COMMAND = "eaglenest report --docs"

__all__ = [
    "CONCURRENCY_SVG",
    "DOCS_TARGETS",
    "HEADLINE_SVG",
    "README_TARGETS",
    "TRAINING_SVG",
    "Generated",
    "check",
    "regenerate",
    "render_readme",
    "stale",
    "write",
]


def render_readme(text: str, repo: Path, path: Path) -> str:
    """``text`` (a README) with every generated block rendered anew from ``repo``'s committed measurements."""
    return render_blocks(text, readme_blocks(repo), README_COMMAND, METRICS_SOURCE, path)


def _page(path: str, source: str, blocks: Callable[[Path], dict[str, list[str]]]) -> Generated:
    """A docs page whose generated blocks (name to lines, from the repository) come from ``source``."""
    return Generated(
        path, lambda old, repo: render_blocks(old, blocks(repo), DOCS_COMMAND, source, repo / path), DOCS_COMMAND
    )


README_TARGET = Generated("README.md", lambda old, repo: render_readme(old, repo, repo / "README.md"), README_COMMAND)
HEADLINE_SVG_TARGET = Generated(HEADLINE_SVG, lambda _old, repo: headline_svg(repo), README_COMMAND)
# What `eaglenest report --readme` writes from the committed metrics.
README_TARGETS = (README_TARGET, HEADLINE_SVG_TARGET)
# What `eaglenest report --docs` writes: every figure drawn from a committed measurement.
DOCS_TARGETS = (
    *README_TARGETS,
    _page("docs/serving.md", SERVE_RECORD, lambda repo: {"serve-concurrency": serving_lines(load_serve_record(repo))}),
    _page("docs/defaults.md", METRICS_SOURCE, lambda repo: {"committed-tau": committed_tau_lines(repo)}),
    Generated(CONCURRENCY_SVG, lambda _old, repo: concurrency_svg(load_serve_record(repo)), DOCS_COMMAND),
    Generated(TRAINING_SVG, render_training_svg, DOCS_COMMAND),
)
