"""What the bench writes and prints: bench.json, the speed-up plot and the summary table."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from eaglenest.core.atomic import atomic_write_bytes, atomic_write_json


def plot_speedup(results: list[dict[str, Any]], stops: int | None, path: Path) -> None:
    """Speed-up against concurrency with the break-even line, written as PNG (atomically)."""
    import io

    from matplotlib.figure import Figure

    points = [(r["concurrency"], r["speedup"]) for r in results if r["speedup"] is not None]
    # a Figure without pyplot: no global state, no display, and savefig renders with Agg
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    if points:
        ax.plot(*zip(*points, strict=True), marker="o", label="draft / baseline tokens/s")
    intervals = [(r["concurrency"], r["speedup_interval"]) for r in results if r.get("speedup_interval")]
    if intervals:
        ax.vlines(
            [c for c, _ in intervals],
            [i["low"] for _, i in intervals],
            [i["high"] for _, i in intervals],
            color="tab:blue",
            alpha=0.5,
            linewidth=2,
            label="95% interval over rounds",
        )
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="break-even")
    if stops is not None:
        ax.axvline(stops, color="tab:red", linestyle=":", linewidth=1, label=f"stops paying at {stops}")
    ax.set_xscale("log", base=2)
    ax.set_xticks([c for c, _ in points] or [1])
    ax.set_xticklabels([str(c) for c, _ in points] or ["1"])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("speed-up")
    ax.set_title("Speculative decoding speed-up against concurrency")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    atomic_write_bytes(path, buffer.getvalue())


def summary_lines(result: dict[str, Any]) -> list[str]:
    """The sweep as a short table, then what it found."""
    lines = [
        f"{'conc':>4}  {'draft tok/s':>11}  {'base tok/s':>10}  {'speed-up':>8}  {'95% interval':>12}  "
        f"{'tau':>5}  {'p50 ms d/b':>15}  {'p99 ms d/b':>15}  {'identical':>9}  {'ties':>4}  {'differ':>6}  "
        f"{'failed':>6}"
    ]
    for r in result["results"]:
        d, b, outputs = r["draft"], r["baseline"], r["outputs"]
        lat = {p: f"{_ms(d, p)}/{_ms(b, p)}" for p in ("p50", "p99")}
        same, ties, differ = (
            ("-", "-", "-")
            if outputs is None
            else (
                f"{outputs['identical']}/{outputs['compared']}",
                str(len(outputs["near_ties"])),
                str(len(outputs["differ"])),
            )
        )
        speedup = "-" if r["speedup"] is None else f"{r['speedup']:.3f}x"
        interval = r.get("speedup_interval")
        within = "-" if interval is None else f"{interval['low']:.3f}-{interval['high']:.3f}"
        tau = "-" if d.get("tau") is None else f"{d['tau']:.2f}"
        lines.append(
            f"{r['concurrency']:>4}  {d['tokens_per_s']:>11.1f}  {b['tokens_per_s']:>10.1f}  {speedup:>8}  "
            f"{within:>12}  {tau:>5}  {lat['p50']:>15}  {lat['p99']:>15}  {same:>9}  {ties:>4}  "
            f"{differ:>6}  {d['failed'] + b['failed']:>6}"
        )
    stops = result["stops_paying_at"]
    rounds = result.get("rounds", 1)
    lines.append(
        (
            f"speculation stops paying at concurrency {stops}"
            if stops is not None
            else "speculation pays at every concurrency measured"
        )
        + (
            f" (speed-ups: geometric means of {rounds} paired rounds)"
            if rounds > 1
            else " (one round: no interval above concurrency 1 but the single-stream one in bench.json)"
        )
    )
    lines += schedule_lines(result.get("schedule"))
    for r in result["results"]:
        for role in ("draft", "baseline"):
            for problem in r[role]["counter_problems"]:
                lines.append(f"check: concurrency {r['concurrency']}, {role}: {problem}")
        outputs = r["outputs"]
        if outputs is not None and outputs["near_ties"]:
            lines.append(
                f"check: concurrency {r['concurrency']}: {len(outputs['near_ties'])} outputs leave the "
                f"baseline's at a near-tie within --tie-margin {result['tie_margin']:g}: "
                f"{_few(outputs['near_ties'], _tie_text)}"
            )
        if outputs is not None and outputs["differ"]:
            lines.append(
                f"check: concurrency {r['concurrency']}: {len(outputs['differ'])} outputs differ from the "
                f"baseline's beyond a near-tie: {_few(outputs['differ'], _difference_text)}"
            )
    return lines


def schedule_lines(schedule: dict[str, Any] | None) -> list[str]:
    """What the run says about K per batch size: the schedule served and where the figures contradict it, or the one
    read from the figures and where it was written."""
    from eaglenest.artifacts.serve_schedule import schedule_text

    if schedule is None:
        return []
    if schedule.get("served") is not None:
        lines = [f"served with K per batch size: {schedule_text([tuple(e) for e in schedule['served']])}"]
        if schedule["slower_than_baseline_at"]:
            lines.append(
                f"check: the scheduled draft is slower than the baseline beyond the noise at concurrency "
                f"{schedule['slower_than_baseline_at']}; --measure-schedule measures the schedule anew"
            )
        return lines
    if schedule.get("derived") is None:
        return [f"K per batch size: not read from this run: {schedule['why']}"]
    derived = schedule_text([tuple(e) for e in schedule["derived"]])
    where = f"written to {schedule['written']}" if schedule["written"] else f"not written: {schedule['why']}"
    return [f"K per batch size read from this run: {derived} ({where})"]


def _few(entries: list[dict[str, Any]], text: Callable[[dict[str, Any]], str], shown: int = 3) -> str:
    more = f"; {len(entries) - shown} more in bench.json" if len(entries) > shown else ""
    return "; ".join(text(e) for e in entries[:shown]) + more


def _tie_text(entry: dict[str, Any]) -> str:
    where = f"request {entry['request']} (prompt {entry['prompt']})"
    if entry["position"] is None:
        return f"{where}: {entry['why']}"
    return (
        f"{where} at token {entry['position']}: baseline {entry['baseline_text']!r}, draft "
        f"{entry['draft_text']!r}, gap {entry['gap']:g}"
    )


def _difference_text(entry: dict[str, Any]) -> str:
    at = f" at token {entry['position']}" if entry.get("position") is not None else ""
    return f"request {entry['request']} (prompt {entry['prompt']}){at}: {entry['why']}"


def _ms(figures: dict[str, Any], key: str) -> str:
    return "-" if figures["latency_ms"] is None else f"{figures['latency_ms'][key]:.0f}"


def write_result(result: dict[str, Any], out: Path) -> None:
    """bench.json, and the plot of what it holds so far."""
    atomic_write_json(out / "bench.json", result)
    if result["results"]:
        plot_speedup(result["results"], result["stops_paying_at"], out / "speedup.png")
