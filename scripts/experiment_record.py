"""Prints the skeleton of an experiment's record for docs/experiments.md, from what the repository holds.

For a DVC experiment (``dvc exp show`` names it), a git revision or ``workspace``, against its base (an
experiment's baseline commit, a commit's parent, the workspace's HEAD, or ``--base``), it fills in what the files
say: the params that differ (``params.yaml``), the command that sets them (``dvc exp run -n NAME -S ...``), the
commit, the host kind that measured the figures (the ``host`` entry of ``metrics/eval/details.json``; older metrics
lack it), the headline figures with their 95% intervals from ``metrics/eval.json`` beside the base's, lossless,
``tau_sim`` and the stage times the metrics record. What the files cannot say (the question, the host's load, the
conclusion) is left as a marked gap to fill in.

    python scripts/experiment_record.py lr-3e-4                 # an experiment, against its baseline commit
    python scripts/experiment_record.py HEAD --base HEAD~3      # a commit, against another
    python scripts/experiment_record.py workspace --title "The demo on a fresh clone"

Everything is read with ``git show`` from files git tracks, as ``eaglenest report`` reads them.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

from eaglenest.artifacts.metrics_file import figure_text as figure
from eaglenest.commands.report import DETAILS, EVAL_METRICS, WORKSPACE, Revision
from eaglenest.commands.summary import host_line
from eaglenest.core.errors import EaglenestError

FILL_IN = "_(fill in: {})_"
PLAIN = re.compile(r"[A-Za-z0-9_./+-][A-Za-z0-9_./:+ -]*")  # a string YAML may read unquoted in a flow
# metrics files whose ``seconds`` is a stage's wall time, in pipeline order
STAGE_SECONDS = {
    "prepare": "metrics/prepare.json",
    "extract": "metrics/extract.json",
    "train": "metrics/train_details.json",
}


def short(revision: Revision) -> str:
    """The revision's commit as the records quote it (seven digits), or ``workspace``."""
    return revision.identity[:7] if revision.ref is not None else WORKSPACE


def base_of(revision: Revision) -> str:
    """What a revision is compared with by default: HEAD for the workspace, else its first parent (an experiment's
    parent is the commit it ran on)."""
    return "HEAD" if revision.ref is None else f"{revision.identity}^"


def changed_params(base: Revision, head: Revision) -> list[tuple[str, Any, Any]]:
    """``(key, base value, head value)`` for every param that differs, in the order of the head's params.yaml."""
    flat: list[dict[str, Any]] = []
    for revision in (base, head):
        values: dict[str, Any] = {}
        text = revision.read("params.yaml")
        flatten_params(yaml.safe_load(text) if text else {}, "", values)
        flat.append(values)
    keys = list(flat[1]) + [key for key in flat[0] if key not in flat[1]]
    return [(key, flat[0].get(key), flat[1].get(key)) for key in keys if flat[0].get(key) != flat[1].get(key)]


def flatten_params(value: Any, prefix: str, out: dict[str, Any]) -> None:
    """Params as ``dvc exp run -S`` names them: sections joined by dots, lists kept whole (a list is one value)."""
    if isinstance(value, dict) and value:
        for key, item in value.items():
            flatten_params(item, f"{prefix}.{key}" if prefix else str(key), out)
    else:
        out[prefix] = value


def yaml_value(value: Any) -> str:
    """A value as ``-S key=VALUE`` takes it: YAML in flow style, strings plain where YAML reads them back as the
    same string (``builtin:chitchat``), else double-quoted."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{yaml_value(key)}: {yaml_value(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(yaml_value(item) for item in value) + "]"
    if isinstance(value, str):
        plain = PLAIN.fullmatch(value) is not None and ": " not in value and yaml.safe_load(value) == value
        return value if plain else json.dumps(value)
    return yaml.safe_dump(value).removesuffix("\n...\n").strip()


def set_flags(changes: list[tuple[str, Any, Any]]) -> str:
    """The ``-S`` flags that set the head's values on the base, quoted for a shell."""
    return " ".join(f"-S {shlex.quote(f'{key}={yaml_value(value)}')}" for key, _, value in changes)


def figures_table(base: Revision, head: Revision) -> list[str]:
    """Per headline set: tau, the speed-up and n-gram's, each ``base → head`` with its 95% interval."""
    metrics = head.read_json(EVAL_METRICS)
    if not isinstance(metrics, dict):
        return [FILL_IN.format(f"{head.rev} has no {EVAL_METRICS}: the figures and where they come from")]
    before = base.read_json(EVAL_METRICS) or {}
    details = head.read_json(DETAILS) or {}
    backend = details.get("headline_backend", "vllm")
    k = details.get("num_speculative_tokens")
    lines = [
        f"**Figures** ({backend}{f', K = {k}' if k else ''}; 95% intervals over prompts; "
        f"{short(base)} → {short(head)}):",
        "",
        "| set | tau | speed-up | draft / fastest free drafter |",
        "|---|---|---|---|",
    ]
    for name, now in metrics.items():
        if not isinstance(now, dict):
            continue
        then = before.get(name) if isinstance(before.get(name), dict) else None
        cells = []
        for key, prefix in ((f"{backend}_tau", ""), (f"{backend}_speedup", "x"), (f"{backend}_vs_free", "x")):
            value = figure(now, key, prefix)
            cells.append(f"{figure(then, key, prefix)} → {value}" if then is not None else value)
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    lines.append("")
    extras = [f"lossless {metrics['lossless']}"] if "lossless" in metrics else []
    train, train_before = head.read_json("metrics/train.json") or {}, base.read_json("metrics/train.json") or {}
    if "tau_sim" in train:
        extras.append(
            f"`tau_sim` {train_before['tau_sim']:.3f} → {train['tau_sim']:.3f}"
            if "tau_sim" in train_before
            else f"`tau_sim` {train['tau_sim']:.3f}"
        )
    seconds = []
    for stage, path in STAGE_SECONDS.items():
        recorded = head.read_json(path)
        if isinstance(recorded, dict) and isinstance(recorded.get("seconds"), int | float):
            seconds.append(f"{stage} {recorded['seconds']:.0f} s")
    if seconds:
        extras.append(
            "stage times " + ", ".join(seconds) + " (as the metrics record them; a stage reused from "
            "the cache keeps its earlier time)"
        )
    return [*lines, "; ".join(extras) + ".", ""] if extras else lines


def record(repo: Path, rev: str, base_rev: str | None = None, title: str | None = None) -> str:
    """The record's Markdown skeleton for ``rev`` against ``base_rev`` (by default :func:`base_of`)."""
    head = Revision(repo, rev)
    base = Revision(repo, base_rev or base_of(head))
    changes = changed_params(base, head)
    is_experiment = head.ref is not None and head.ref.startswith("refs/exps/")
    change = (
        "; ".join(f"`{key}` {yaml_value(old)} → {yaml_value(new)}" for key, old, new in changes) or "none to the params"
    )
    if is_experiment:
        command = f"`dvc exp run -n {rev} {set_flags(changes)}`".replace(" `", "`")
    else:
        command = FILL_IN.format("what ran it: `make demo` in a fresh clone, `dvc repro`, a `bench/` script") + (
            f"; the params as `dvc exp run {set_flags(changes)}`" if changes else ""
        )
    commit = short(base) if is_experiment else short(head)
    details = head.read_json(DETAILS) or {}
    host = (
        host_line(details.get("host"))
        if details.get("host")
        else FILL_IN.format(
            "the CPU model and whether it computes bf16 natively (AVX512-BF16, AMX) or not (AVX2 "
            "only); the metrics predate the host record"
        )
    )
    lines = [
        f"### {title or (rev if is_experiment else 'TITLE')}",
        "",
        f"**Question**: {FILL_IN.format('what this experiment asks')}",
        "",
        f"**Change**: {change} (against {short(base)}).",
        "",
        f"**Command**: {command}.",
        "",
        f"**Commit**: {commit}"
        + (
            f" (the experiment's baseline; `dvc exp show` lists {rev})"
            if is_experiment
            else " (the workspace's HEAD; the run's changes are not committed)"
            if head.ref is None
            else ""
        )
        + ".",
        "",
        f"**Host**: {host}; {FILL_IN.format('what else ran on it')}.",
        "",
        *figures_table(base, head),
        f"Paired differences, prompt by prompt: `eaglenest report {short(base)} {rev}`.",
        "",
        f"**Conclusion**: {FILL_IN.format('what the figures say, and which default it changes or keeps')}",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", metavar="REV", help=f"a DVC experiment's name, a git revision or {WORKSPACE!r}")
    parser.add_argument(
        "--base",
        default=None,
        help="the revision to compare with (default: an experiment's "
        "baseline commit, a commit's parent, the workspace's HEAD)",
    )
    parser.add_argument("--title", default=None, help="the record's heading (default: the experiment's name)")
    parser.add_argument("--repo", default=".", help="the repository (default: the current folder)")
    args = parser.parse_args(argv)
    try:
        print(record(Path(args.repo), args.rev, args.base, args.title), end="")
    except EaglenestError as err:
        print(f"experiment_record.py: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
