"""``eaglenest summary``: the headline figures as a short table, what ``make demo`` ends with.

It reads the declared metrics (``metrics/eval.json``, ``metrics/train.json``) and, for the training estimate
beside the decoded figure of the same split and the host kind that measured the figures,
``metrics/eval/details.json``; and the K ``eaglenest serve`` uses for the draft, with why
(:func:`eaglenest.artifacts.k_record.served_k` over the k_sweep stage's ``metrics/k_sweep.json``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from eaglenest.artifacts.k_record import K_RECORD_FILE, served_k
from eaglenest.commands.command import Command
from eaglenest.core.errors import InputFileError


def read_json(path: Path) -> dict[str, Any]:
    """A metrics file, or one line naming the file and what is wrong with it."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise InputFileError(f"{path}: not found; run the pipeline first (dvc repro)") from None
    except json.JSONDecodeError as err:
        raise InputFileError(f"{path}: not valid JSON: {err.msg}") from None


def _interval(value: float | None, half_width: float | None, prefix: str = "") -> str:
    if value is None:
        return "—"
    return f"{prefix}{value:.3f} ± {half_width:.3f}" if half_width is not None else f"{prefix}{value:.3f}"


def figure(figures: dict[str, Any], key: str, prefix: str = "") -> str:
    """``figures[key]`` with its ``_ci95`` half-width where the metrics hold one."""
    return _interval(figures.get(key), figures.get(f"{key}_ci95"), prefix)


def summary_lines(repo: Path) -> list[str]:
    """The table: per headline set, tau, the single-stream speed-up and the n-gram baseline's, with their 95%
    intervals; then lossless, and tau_sim beside the decoded tau of the validation split."""
    headline = read_json(repo / "metrics" / "eval.json")
    train = read_json(repo / "metrics" / "train.json")
    details_path = repo / "metrics" / "eval" / "details.json"
    details = read_json(details_path) if details_path.exists() else {}
    backend = details.get("headline_backend", "vllm")
    rows = [("set", f"{backend} tau (95%)", "speed-up (95%)", "n-gram speed-up (95%)")]
    for name, figures in headline.items():
        if not isinstance(figures, dict):
            continue
        rows.append((name, figure(figures, f"{backend}_tau"), figure(figures, f"{backend}_speedup", "x"),
                     figure(figures, f"{backend}_ngram_speedup", "x")))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.append(f"lossless: {headline.get('lossless', '—')}")
    val = details.get("runs", {}).get(backend, {}).get("sets", {}).get("val")
    decoded = ""
    if val:
        tau = val["summary"]["tau"]
        decoded = f"; decoded tau of the same split ({backend}): {_interval(tau['value'], tau['ci95'])}"
    if "tau_sim" in train:
        lines.append(f"train: tau_sim {train['tau_sim']:.3f} (validation split, teacher-forced){decoded}")
    lines.append(f"measured on: {host_line(details.get('host'))}")
    draft = repo / "models" / "draft"
    if (draft / "config.json").is_file():
        lines.append(served_k(draft, record_file=repo / K_RECORD_FILE).line())
    return lines


def host_line(host: dict[str, Any] | None) -> str:
    """The host kind a metrics file records, for people; where it records none, the files predate the record."""
    if not host:
        return "a host the metrics do not record (run dvc repro -f -s evaluate to record it)"
    if host.get("gpu"):
        return f"{host['gpu']}, {host.get('compute_dtype', '?')}"
    native = "bf16 native" if host.get("bf16_native") else "no native bf16"
    simulated = f", simulated {host['simulated']}" if host.get("simulated") else ""
    return f"{host['cpu']}, {host['aten_capability']} ({native}{simulated}), computing in " \
           f"{host.get('compute_dtype', '?')}"


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repo", default=".", help="the repository (default: the current folder)")


def _run(args: argparse.Namespace) -> int:
    print("\n".join(summary_lines(Path(args.repo))))
    return 0


COMMAND = Command("summary", help="the headline figures of the workspace as a short table",
                  add_arguments=_add_arguments, run=_run)
