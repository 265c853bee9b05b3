"""``eaglenest summary``: the headline figures as a short table, what ``make demo`` ends with.

It reads the declared metrics (``metrics/eval.json``, ``metrics/train.json``) and, for the training estimate
beside the decoded figure of the same split and the host kind that measured the figures,
``metrics/eval/details.json``; and the K ``eaglenest serve`` uses for the draft, with why
(:func:`eaglenest.artifacts.k_record.served_k` over the k_sweep stage's ``metrics/k_sweep.json``), and its K per batch
size (:func:`eaglenest.artifacts.serve_schedule.served_schedule` over ``metrics/serve_schedule.json``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from eaglenest.artifacts.k_record import K_RECORD_FILE, served_k
from eaglenest.artifacts.metrics_file import figure_text, read_metrics, summary_figure_text, versus_text
from eaglenest.artifacts.serve_schedule import SCHEDULE_FILE, served_schedule
from eaglenest.commands.command import Command
from eaglenest.core.errors import InputFileError


def summary_lines(repo: Path) -> list[str]:
    """The table: per headline set, tau, the single-stream speed-up and the n-gram baseline's, and the draft's speed
    over n-gram's (paired) with the verdict, with their 95% intervals; then lossless, and tau_sim beside the decoded
    tau of the validation split."""
    headline = read_metrics(repo / "metrics" / "eval.json")
    train = read_metrics(repo / "metrics" / "train.json")
    details_path = repo / "metrics" / "eval" / "details.json"
    details = read_metrics(details_path) if details_path.exists() else {}
    backend = details.get("headline_backend", "vllm")
    sets = details.get("runs", {}).get(backend, {}).get("sets", {})
    rows = [
        (
            "set",
            f"{backend} tau (95%)",
            "speed-up (95%)",
            "n-gram speed-up (95%)",
            "suffix speed-up (95%)",
            "draft / fastest free (95%)",
        )
    ]
    for name, figures in headline.items():
        if not isinstance(figures, dict):
            continue
        summary = sets.get(name, {}).get("summary", {})
        rows.append(
            (
                name,
                figure_text(figures, f"{backend}_tau"),
                figure_text(figures, f"{backend}_speedup", "x"),
                summary_figure_text(summary, "ngram_speedup", "x"),
                summary_figure_text(summary, "suffix_speedup", "x"),
                versus_text(figures, backend, summary),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.append(f"lossless: {headline.get('lossless', '—')}")
    val = sets.get("val")
    decoded = ""
    if val:
        decoded = f"; decoded tau of the same split ({backend}): {summary_figure_text(val['summary'], 'tau')}"
    if "tau_sim" in train:
        lines.append(f"train: tau_sim {train['tau_sim']:.3f} (validation split, teacher-forced){decoded}")
    lines.append(f"measured on: {host_line(details.get('host'))}")
    draft = repo / "models" / "draft"
    if (draft / "config.json").is_file():
        choice = served_k(draft, record_file=repo / K_RECORD_FILE)
        lines.append(choice.line())
        try:
            lines.append(served_schedule(draft, choice.k, repo / SCHEDULE_FILE).line())
        except InputFileError as err:  # the table still stands; serve refuses the file in the same words
            lines.append(f"K per batch size: {err}")
    return lines


def host_line(host: dict[str, Any] | None) -> str:
    """The host kind a metrics file records, for people; where it records none, the files predate the record."""
    if not host:
        return "a host the metrics do not record (run dvc repro -f -s evaluate to record it)"
    if host.get("gpu"):
        return f"{host['gpu']}, {host.get('compute_dtype', '?')}"
    native = "bf16 native" if host.get("bf16_native") else "no native bf16"
    simulated = f", simulated {host['simulated']}" if host.get("simulated") else ""
    return (
        f"{host['cpu']}, {host['aten_capability']} ({native}{simulated}), computing in {host.get('compute_dtype', '?')}"
    )


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repo", default=".", help="the repository (default: the current folder)")


def _run(args: argparse.Namespace) -> int:
    print("\n".join(summary_lines(Path(args.repo))))
    return 0


COMMAND = Command(
    "summary", help="the headline figures of the workspace as a short table", add_arguments=_add_arguments, run=_run
)
