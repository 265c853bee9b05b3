"""K per batch size, read from the bench's figures: where speculation pays, the K served; where it stops, 0.

**Pays** means the speed-up's 95% interval over rounds lies wholly above 1
(:func:`eaglenest.commands.bench.figures.rounds_interval`). The goal is a served draft never slower than plain
decoding, so the burden of proof is on speculation: a tie within the noise is served plain, and a concurrency
measured without an interval (one round) proves nothing.

**Between and past the concurrencies measured**, the speed-up of one K is taken to fall as the batch grows: the K
extra tokens a sequence brings to the verify step are nearly free while the step is bound by reading the weights and
cost their share once it is bound by compute, and the draft's own steps grow with the batch too (the bench's
committed figures fall so: x1.08 at 1, x0.78 at 4, x0.60 at 16). So a measured concurrency vouches for the batch
sizes below it, not above it, and each batch size takes the K of the nearest concurrency measured at or above it:
the schedule speculates from batch size 1 up to the last concurrency of the unbroken run of paying ones, and is 0
from there on, the unmeasured gap up to the first concurrency that does not pay included (conservative), and past
the largest concurrency measured. A concurrency that pays again after one that does not is taken for noise and
served plain. To narrow a gap, measure more concurrencies (``--concurrency 1 2 3 4 8 16``): each costs a run per
server and round.

The rule is a pure function of the measured points, so it is tested without a server; a later measurement of
several Ks per concurrency feeds it the same way (it takes the paying K with the best speed-up, ties to the smaller).
"""

from __future__ import annotations

from typing import Any

from eaglenest.artifacts.serve_schedule import MeasuredPoint, Schedule

PAYS_ABOVE = 1.0
RULE = (
    "K where the speed-up's 95% interval over rounds lies wholly above 1, from batch size 1 up to the last "
    "concurrency of the unbroken run of such concurrencies (a measured concurrency vouches for the batch sizes "
    "below it); 0 everywhere else: at a tie, where it is slower, in the unmeasured gap before the first "
    "concurrency that does not pay, and past the largest concurrency measured"
)


def pays(low: float | None) -> bool:
    """Whether speculation pays, by the lower end of the speed-up's 95% interval (None, no interval: it does not)."""
    return low is not None and low > PAYS_ABOVE


def derive_schedule(points: list[MeasuredPoint], max_num_seqs: int) -> Schedule:
    """The schedule from the measured points (:data:`RULE`), its last range ending at ``max_num_seqs``.

    Args:
        points: Per concurrency (and K), the speed-up with its interval and whether it pays.
        max_num_seqs: The server's largest batch.

    Returns:
        vLLM's ``[first, last, K]`` ranges, adjacent ranges of one K merged.
    """
    by_concurrency: dict[int, list[MeasuredPoint]] = {}
    for point in points:
        by_concurrency.setdefault(point.concurrency, []).append(point)
    ranges: list[tuple[int, int, int]] = []
    start = 1
    for concurrency in sorted(by_concurrency):
        paying = [p for p in by_concurrency[concurrency] if p.pays]
        if not paying or start > max_num_seqs:
            break
        best = max(paying, key=lambda p: (p.speedup, -p.k))
        end = min(concurrency, max_num_seqs)
        ranges.append((start, end, best.k))
        start = end + 1
    if start <= max_num_seqs:
        ranges.append((start, max_num_seqs, 0))
    merged: list[tuple[int, int, int]] = []
    for first, last, k in ranges:
        if merged and merged[-1][2] == k:
            merged[-1] = (merged[-1][0], last, k)
        else:
            merged.append((first, last, k))
    return merged


def measured_points(rows: list[dict[str, Any]], k: int) -> list[MeasuredPoint]:
    """The bench's rows as measured points of the draft at ``k``: per concurrency with both servers measured, the
    speed-up, its interval over rounds (None with one round) and whether it pays."""
    points = []
    for row in rows:
        if row.get("speedup") is None:
            continue
        interval = row.get("speedup_interval")
        low, high = (None, None) if interval is None else (interval["low"], interval["high"])
        points.append(
            MeasuredPoint(
                concurrency=row["concurrency"],
                k=k,
                speedup=row["speedup"],
                low=low,
                high=high,
                rounds=len([r for r in row.get("rounds", []) if r.get("speedup") is not None]),
                pays=pays(low),
            )
        )
    return points


def server_blocks(rounds: int) -> list[tuple[str, list[int]]]:
    """The order ``--serve`` runs the rounds in, one server at a time: (role, rounds it runs before it is stopped).

    Each round pairs a run of the draft server with one of the baseline server at every concurrency, one right after
    the other, and the pair's order alternates (draft first, then baseline first, ...), so a drift of the machine
    over the bench falls on both sides alike and cancels over the rounds; the last pair ends on the baseline, which
    then answers the near-tie checks of every pair. Consecutive runs of one server share its start: 3 rounds start
    4 servers (draft | baseline, baseline | draft, draft | baseline), not 6.
    """
    order: list[tuple[str, int]] = []
    for number in range(rounds):
        draft_first = (rounds - 1 - number) % 2 == 0
        order += [("draft", number), ("baseline", number)] if draft_first else [("baseline", number), ("draft", number)]
    blocks: list[tuple[str, list[int]]] = []
    for role, number in order:
        if blocks and blocks[-1][0] == role:
            blocks[-1][1].append(number)
        else:
            blocks.append((role, [number]))
    return blocks


def schedule_result(config: Any, result: dict[str, Any], draft_command: Any, status: int) -> dict[str, Any]:
    """bench.json's ``schedule``: the schedule the draft server served and how the figures bear it out, or the one
    read from them (written to ``--schedule`` with ``--serve``, where the run can vouch for it).

    Args:
        config: The flags (:class:`~eaglenest.commands.bench.config.BenchConfig`).
        result: bench.json as measured.
        draft_command: The draft server's :class:`~eaglenest.commands.serve.command.ServeCommand` (``--serve``),
            else None.
        status: The bench's exit status so far: a run with a failed request or a real output difference writes no
            record.
    """
    from dataclasses import asdict

    from eaglenest.commands.serve.command import server_max_num_seqs

    rows = result["results"]
    if draft_command is not None and draft_command.schedule is not None:
        slower = [r["concurrency"] for r in rows if (r.get("speedup_interval") or {}).get("high", 2.0) < PAYS_ABOVE]
        return {
            "served": [list(entry) for entry in draft_command.schedule],
            "why": draft_command.schedule_reason,
            "derived": None,
            "written": None,
            "slower_than_baseline_at": slower,
            "note": "the draft server served this schedule, so the figures check it rather than measure one; "
            "--measure-schedule measures the draft at one K at every batch size",
        }
    k = draft_command.k if draft_command is not None else _k_from_counters(rows)
    entry: dict[str, Any] = {"served": None, "k": k, "derived": None, "written": None}
    if config.rounds < 2:
        return entry | {
            "why": "one round gives no interval at any concurrency, and a schedule speculates only where "
            "the interval lies above 1; --rounds 3 measures one"
        }
    if k is None:
        return entry | {"why": "the draft server's K is not known: its /metrics count no draft position"}
    vllm_args = list(config.serve.vllm_args) if config.serve is not None else []
    max_num_seqs = server_max_num_seqs(vllm_args) or max(result["concurrency"])
    points = measured_points(rows, k)
    schedule = derive_schedule(points, max_num_seqs)
    entry |= {
        "max_num_seqs": max_num_seqs,
        "rule": RULE,
        "measured": [asdict(p) for p in points],
        "derived": [list(e) for e in schedule],
    }
    if config.serve is None:
        return entry | {
            "why": "--url: bench does not know the served draft's files, so it writes no record; "
            "`eaglenest bench --serve` does"
        }
    if config.serve.baseline != "none":
        return entry | {
            "why": f"the baseline was {config.serve.baseline} drafting, and a schedule says where the "
            "draft beats plain decoding: --baseline none measures it; no record written"
        }
    if status != 0:
        return entry | {
            "why": "a request failed or an output differs from the baseline's beyond a near-tie: no "
            "record written from this run"
        }
    from eaglenest.artifacts.serve_schedule import write_schedule_record
    from eaglenest.core.host import host_kind, host_record
    from eaglenest.stages.k_sweep import short_commit

    details = {
        "baseline": config.serve.baseline,
        "rounds": config.rounds,
        "prompts": str(config.prompts),
        "requests": result["prompts"]["requests"],
        "max_tokens": config.max_tokens,
        "temperature": config.temperature,
        "bench": str(config.out / "bench.json"),
    }
    write_schedule_record(
        config.serve.schedule,
        config.serve.draft,
        k,
        schedule,
        max_num_seqs,
        RULE,
        points,
        details,
        short_commit(),
        {**host_record(draft_command.dtype), "label": host_kind().label},
    )
    return entry | {
        "written": str(config.serve.schedule),
        "why": f"the draft served at K={k} at every batch size, {config.rounds} rounds",
    }


def _k_from_counters(rows: list[dict[str, Any]]) -> int | None:
    """The K of a draft server bench did not start: the draft positions its /metrics count."""
    for row in rows:
        positions = (row.get("draft") or {}).get("accepted_per_position")
        if positions:
            return len(positions)
    return None
