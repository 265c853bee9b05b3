"""The served draft under load: the committed ``eaglenest bench --serve`` result, and the figures drawn from it.

``bench/results/serve_concurrency.json`` is ``eaglenest bench``'s own ``bench.json`` with one key added,
``recorded``: the command that ran it, the commit it ran at and the host kind it ran on
(``python scripts/record_serve_bench.py OUT/bench.json --command '...'`` adds it on the machine that ran the bench).
From it ``eaglenest report --docs`` renders the table of docs/serving.md, the README headline's speed-ups at each
concurrency and ``docs/img/concurrency.svg``; where it is not committed, the blocks say which commands fill them.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.artifacts.serve_schedule import schedule_text
from eaglenest.commands.generated.svg import BLUE, ORANGE, label_bars, new_figure, page_style, svg_text
from eaglenest.core.errors import InputFileError

SERVE_RECORD = "bench/results/serve_concurrency.json"
CONCURRENCY_SVG = "docs/img/concurrency.svg"
BENCH_COMMAND = (
    "eaglenest bench --serve --prompts data/eval/general.jsonl --concurrency 1 4 16 --out bench/results/serve"
)
RECORD_COMMAND = f"python scripts/record_serve_bench.py bench/results/serve/bench.json --command '{BENCH_COMMAND}'"
BASELINES = {"none": "plain decoding", "ngram": "n-gram drafting", "suffix": "suffix decoding"}


@dataclass(frozen=True)
class Level:
    """One concurrency of the sweep: the draft server against the baseline server.

    Attributes:
        concurrency: Requests in flight.
        speedup: The draft's output tokens/s over the baseline's.
        draft_tokens_per_s: The draft server's output tokens/s.
        baseline_tokens_per_s: The baseline server's.
        tau: Tokens per verify step from the draft server's counters; None where it counted none.
        p50_ms: Median request latency (draft, baseline).
        outputs: Outputs identical to the baseline's, near-ties, other differences; None where not compared.
        interval: The speed-up's 95% interval over rounds (low, high); None for a bench of one round.
    """

    concurrency: int
    speedup: float
    draft_tokens_per_s: float
    baseline_tokens_per_s: float
    tau: float | None
    p50_ms: tuple[float, float]
    outputs: tuple[int, int, int] | None
    interval: tuple[float, float] | None = None


@dataclass(frozen=True)
class ServeRecord:
    """The committed bench result: what was measured, how, where.

    Attributes:
        command: The command that ran the bench.
        commit: The commit it ran at.
        host: The host kind it ran on, as people read it.
        model: The served model's name.
        baseline: What the baseline server did (plain decoding, n-gram drafting).
        requests: Requests per concurrency per server.
        max_tokens: Output tokens per request.
        temperature: Sampling temperature.
        levels: One entry per concurrency measured, in the order run.
        stops_paying_at: The lowest concurrency whose speed-up is below 1; None where none is.
        rounds: Paired runs per concurrency (a bench before rounds records none: one).
        schedule: The K per batch size the draft server served, in words; None where it served one K throughout.
    """

    command: str
    commit: str
    host: str
    model: str
    baseline: str
    requests: int
    max_tokens: int
    temperature: float
    levels: tuple[Level, ...]
    stops_paying_at: int | None
    rounds: int = 1
    schedule: str | None = None

    @property
    def runs_text(self) -> str:
        """How many runs each figure comes from, and so whether it has an interval."""
        if self.rounds == 1:
            return "one run, so no interval"
        return f"{self.rounds} paired rounds: each speed-up is their geometric mean, with its 95% interval"

    def at(self, concurrency: int) -> Level | None:
        """The level measured at ``concurrency``, or None."""
        return next((level for level in self.levels if level.concurrency == concurrency), None)


class _Reader:
    """Reads keys of the record, naming the file and the key in one line where one is missing or mistyped."""

    def __init__(self, path: str) -> None:
        self.path = path

    def get(self, node: Any, key: str, kind: type | tuple[type, ...], where: str = "") -> Any:
        name = f"{where}.{key}" if where else key
        value = node.get(key) if isinstance(node, dict) else None
        if isinstance(value, bool) or not isinstance(value, kind):
            raise InputFileError(
                f"{self.path}: no {name} (expected {_kind_name(kind)}); the figures of "
                f"docs/serving.md and {CONCURRENCY_SVG} need it"
            )
        return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(
        {"int": "an integer", "float": "a number", "str": "text", "dict": "an object", "list": "a list"}[k.__name__]
        for k in kinds
    )


def _level(read: _Reader, row: Any, where: str) -> Level:
    number = (int, float)
    draft = read.get(row, "draft", dict, where)
    baseline = read.get(row, "baseline", dict, where)
    outputs = row.get("outputs") if isinstance(row, dict) else None
    counts = None
    if isinstance(outputs, dict):
        near = len(read.get(outputs, "near_ties", list, f"{where}.outputs"))
        differ = len(read.get(outputs, "differ", list, f"{where}.outputs"))
        counts = (read.get(outputs, "identical", int, f"{where}.outputs"), near, differ)
    tau = draft.get("tau")
    interval = row.get("speedup_interval") if isinstance(row, dict) else None
    bounds = None
    if isinstance(interval, dict):
        bounds = (
            read.get(interval, "low", number, f"{where}.speedup_interval"),
            read.get(interval, "high", number, f"{where}.speedup_interval"),
        )
    return Level(
        concurrency=read.get(row, "concurrency", int, where),
        speedup=read.get(row, "speedup", number, where),
        draft_tokens_per_s=read.get(draft, "tokens_per_s", number, f"{where}.draft"),
        baseline_tokens_per_s=read.get(baseline, "tokens_per_s", number, f"{where}.baseline"),
        tau=float(tau) if isinstance(tau, int | float) else None,
        p50_ms=(
            read.get(read.get(draft, "latency_ms", dict, f"{where}.draft"), "p50", number, f"{where}.draft.latency_ms"),
            read.get(
                read.get(baseline, "latency_ms", dict, f"{where}.baseline"),
                "p50",
                number,
                f"{where}.baseline.latency_ms",
            ),
        ),
        outputs=counts,
        interval=bounds,
    )


def parse_serve_record(document: Any, path: str) -> ServeRecord:
    """The record of a bench.json with its ``recorded`` key.

    Raises:
        InputFileError: A key the figures need is missing or of the wrong type (one line naming file and key).
    """
    read = _Reader(path)
    recorded = read.get(document, "recorded", dict)
    host = read.get(recorded, "host", dict, "recorded")
    rows = read.get(document, "results", list)
    if not rows:
        raise InputFileError(f"{path}: results is empty: the bench measured no concurrency")
    baseline = ((document.get("servers") or {}).get("baseline") or {}).get("kind")
    stops = document.get("stops_paying_at")
    return ServeRecord(
        command=read.get(recorded, "command", str, "recorded"),
        commit=read.get(recorded, "commit", str, "recorded"),
        host=host.get("label") or read.get(host, "key", str, "recorded.host"),
        model=read.get(document, "model", str),
        baseline=BASELINES.get(baseline, "the baseline server"),
        requests=read.get(read.get(document, "prompts", dict), "requests", int, "prompts"),
        max_tokens=read.get(document, "max_tokens", int),
        temperature=float(read.get(document, "temperature", (int, float))),
        levels=tuple(_level(read, row, f"results[{i}]") for i, row in enumerate(rows)),
        stops_paying_at=stops if isinstance(stops, int) else None,
        rounds=document["rounds"] if isinstance(document.get("rounds"), int) else 1,
        schedule=_served_schedule(document),
    )


def _served_schedule(document: dict[str, Any]) -> str | None:
    """The K per batch size the bench's draft server served (its ``schedule.served``), in words, or None."""
    served = (document.get("schedule") or {}).get("served")
    return schedule_text([tuple(entry) for entry in served]) if isinstance(served, list) and served else None


def load_serve_record(repo: Path) -> ServeRecord | None:
    """``repo``'s committed bench result, or None where none is committed."""
    path = repo / SERVE_RECORD
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as err:
        raise InputFileError(f"{path}: not valid JSON: {err.msg} (line {err.lineno})") from None
    return parse_serve_record(document, str(path))


def record_bench(bench_json: Path, command: str, repo: Path, out: Path) -> ServeRecord:
    """Writes ``out``: ``bench_json`` with ``recorded`` (``command``, the commit of ``repo``, this host's kind).

    Raises:
        InputFileError: The bench result lacks what the figures need, or ``repo`` has no commit.
    """
    from eaglenest.core.atomic import atomic_write_bytes
    from eaglenest.core.host import host_kind, host_record

    try:
        document = json.loads(bench_json.read_text())
    except (FileNotFoundError, json.JSONDecodeError) as err:
        raise InputFileError(f"{bench_json}: not a bench result ({err})") from None
    head = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=repo, capture_output=True, text=True)
    if head.returncode != 0:
        raise InputFileError(f"{repo}: not a git checkout with a commit; the record names the commit it ran at")
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo, capture_output=True, text=True
    ).stdout.strip()
    commit = head.stdout.strip() + (" (with uncommitted changes)" if dirty else "")
    document["recorded"] = {"command": command, "commit": commit, "host": {**host_record(), "label": host_kind().label}}
    record = parse_serve_record(document, str(bench_json))
    atomic_write_bytes(out, (json.dumps(document, indent=2) + "\n").encode())
    return record


def _speedup(level: Level) -> str:
    return f"x{level.speedup:.2f}"


def headline_clause(record: ServeRecord | None) -> str:
    """The README headline's sentence on the served draft under load."""
    if record is None:
        return (
            f"Served under load: not measured at this commit (`{BENCH_COMMAND}`, recorded in "
            f"{SERVE_RECORD}; [serving](docs/serving.md#measured-the-served-draft-under-load))."
        )
    single = record.at(1)
    rest = [level for level in record.levels if level.concurrency != 1]
    parts = ([f"{_speedup(single)} single-stream"] if single else []) + [
        f"{_speedup(level)} at {level.concurrency} requests in flight" for level in rest
    ]
    served = f" with its K per batch size ({record.schedule})" if record.schedule else ""
    return (
        f"Served by `eaglenest serve`{served} and measured by `eaglenest bench` against {record.baseline}, "
        f"with the draft of {record.commit.split()[0]}: "
        f"{', '.join(parts)} ({record.requests} requests per concurrency, "
        f"{'one run' if record.rounds == 1 else f'{record.rounds} rounds'}, on {record.host}; "
        f"{SERVE_RECORD})."
    )


def _row(level: Level) -> str:
    tau = "—" if level.tau is None else f"{level.tau:.4f}"
    outputs = "—" if level.outputs is None else " / ".join(str(n) for n in level.outputs)
    interval = "" if level.interval is None else f" ({level.interval[0]:.3f}–{level.interval[1]:.3f})"
    return (
        f"| {level.concurrency} | {level.draft_tokens_per_s:.1f} | {level.baseline_tokens_per_s:.1f} | "
        f"x{level.speedup:.3f}{interval} | {tau} | {level.p50_ms[0]:,.0f} / {level.p50_ms[1]:,.0f} | {outputs} |"
    )


def serving_lines(record: ServeRecord | None) -> list[str]:
    """docs/serving.md's block: the table of the committed bench result and its figure, or how to fill it."""
    if record is None:
        return [
            f"Not measured at this commit: no `{SERVE_RECORD}`. On the demo's checkout, `{BENCH_COMMAND}`, then "
            f"`{RECORD_COMMAND}` and `eaglenest report --docs` fill this block, the README's headline and "
            "the figure."
        ]
    stops = (
        f"speculation stops paying at concurrency {record.stops_paying_at}"
        if record.stops_paying_at
        else "speculation pays at every concurrency measured"
    )
    return [
        f"Measured on `{record.model}` at {record.commit}, on {record.host}: `{record.command}` "
        f"({record.requests} requests per concurrency, {record.max_tokens} tokens each, temperature "
        f"{record.temperature:g}; {record.runs_text}). The baseline is {record.baseline}; {stops}.",
        "",
        "| concurrency | draft tokens/s | baseline tokens/s | speed-up | tau | p50 latency draft / baseline (ms) "
        "| outputs identical / near-tie / other |",
        "|---|---|---|---|---|---|---|",
        *(_row(level) for level in record.levels),
        "",
        "![Speed-up of the served draft against concurrency](img/concurrency.svg)",
    ]


def concurrency_svg(record: ServeRecord | None) -> str | None:
    """docs/img/concurrency.svg: output tokens/s of both servers (left) and the speed-up with the 1.0 line (right)
    against concurrency; None where no result is committed."""
    if record is None:
        return None
    levels = [str(level.concurrency) for level in record.levels]
    positions = list(range(len(levels)))
    with page_style():
        fig = new_figure(8, 2.8)
        left, right = fig.subplots(1, 2)
        width = 0.38
        for offset, values, label, colour in (
            (-width / 2, [lv.draft_tokens_per_s for lv in record.levels], "the draft", BLUE),
            (width / 2, [lv.baseline_tokens_per_s for lv in record.levels], record.baseline, ORANGE),
        ):
            left.bar([p + offset for p in positions], values, width, color=colour, label=label)
        left.set_title("output tokens/s")
        left.legend(loc="upper left", frameon=False)
        speedups = [level.speedup for level in record.levels]
        right.plot(positions, speedups, marker="o", color=BLUE)
        for x, level in zip(positions, record.levels, strict=True):
            if level.interval is not None:  # the 95% interval over rounds
                right.vlines(x, *level.interval, color=BLUE, linewidth=1.5, alpha=0.6)
        for x, value in zip(positions, speedups, strict=True):
            right.annotate(
                f"{value:.2f}", (x, value), textcoords="offset points", xytext=(0, 5), ha="center", fontsize=7
            )
        right.axhline(1.0, color="black", linewidth=0.8)
        bounds = [b for level in record.levels for b in (level.interval or (level.speedup, level.speedup))]
        right.set_ylim(min(0.8, min(bounds) - 0.1), max(1.2, max(bounds) + 0.15))
        right.set_title(f"speed-up over {record.baseline}")
        for axes in (left, right):
            axes.set_xticks(positions, levels)
            axes.set_xlabel("requests in flight")
        label_bars(left)
        runs = "one run" if record.rounds == 1 else f"{record.rounds} rounds"
        fig.suptitle(f"{SERVE_RECORD} ({record.model}, {record.requests} requests per concurrency, {runs})", fontsize=9)
        fig.tight_layout()
        return svg_text(fig)
