"""The schedule record: K per batch size for one draft, as ``eaglenest bench --serve`` measured it, and the rule that
picks the schedule ``eaglenest serve`` hands vLLM.

vLLM (0.32 on CPU, 0.33 on GPU) takes ``speculative_config["num_speculative_tokens_per_batch_size"]``: inclusive
``[first, last, K]`` ranges of the batch size (the requests in one scheduler step), the first starting at 1, sorted
and disjoint, ``K >= 0`` (0: no speculation in that step). Its scheduler expands them into one K per batch size up to
the server's ``max_num_seqs`` (``vllm.v1.spec_decode.dynamic.utils.build_dynamic_sd_schedule_lookup``): a gap
between two ranges takes the K before it, batch sizes past the last range take the last K, and every K is capped at
``num_speculative_tokens``. A schedule here therefore always starts at 1 and its last range ends at the server's
``max_num_seqs`` (:func:`fit_schedule`), so what the file says is what the server does at every batch size.

``metrics/serve_schedule.json`` (beside the K record, :mod:`eaglenest.artifacts.k_record`)::

    {"draft": {"path", "sha256"},            # the draft measured; its fingerprint is the K record's
     "k": 2,                                 # the K the draft server served at every batch size while measured
     "schedule": [[1, 1, 2], [2, 128, 0]],   # vLLM's ranges, the last one ending at max_num_seqs
     "max_num_seqs": 128,                    # the measured server's (vLLM's default for the build, or the flag)
     "rule": "...",                          # how the schedule was read from the figures, in words
     "measured": [{"concurrency": 1, "k": 2, "speedup": 1.08, "low": 1.03, "high": 1.13, "rounds": 3,
                   "pays": true}, ...],      # per concurrency, the speed-up over plain with its 95% interval
     "baseline": "none", "rounds": 3, "prompts": "...", "requests": 64, "max_tokens": 64, "temperature": 0.0,
     "bench": "bench/results/serve/bench.json",
     "commit": "58d8123", "host": {...}}     # eaglenest.core.host.host_record, with the dtype served and a label

Only a record of this very draft (its sha256) measured at the K served is used (:func:`served_schedule`); the
schedule is derived in ``eaglenest.commands.bench.schedule``, and this module alone reads and writes the file.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eaglenest.artifacts.draft_hash import draft_fingerprint
from eaglenest.core.atomic import atomic_write_json
from eaglenest.core.errors import InputFileError

SCHEDULE_FILE = Path("metrics/serve_schedule.json")
MEASURE_HINT = "`eaglenest bench --serve` measures one"
REMEASURE_HINT = (
    "`eaglenest bench --serve --measure-schedule` measures it again, and `eaglenest serve --no-schedule` "
    "serves without it"
)

# (first batch size, last batch size, K), inclusive, as vLLM's parser returns them
Schedule = list[tuple[int, int, int]]


@dataclass(frozen=True)
class MeasuredPoint:
    """The draft against plain decoding at one concurrency, as the schedule was read from it.

    Attributes:
        concurrency: Requests in flight (closed loop: the batch size of most steps of the run).
        k: The K the draft server served.
        speedup: The draft's output tokens/s over the baseline's.
        low: The 95% interval's lower end; None where the run gave no interval.
        high: Its upper end; None likewise.
        rounds: The paired runs the figure and interval come from.
        pays: Whether speculation paid there, by the rule the record names.
    """

    concurrency: int
    k: int
    speedup: float
    low: float | None
    high: float | None
    rounds: int
    pays: bool


@dataclass(frozen=True)
class ScheduleRecord:
    """What a record says: the draft it was measured on, the K served while measuring, and the schedule."""

    sha256: str
    k: int
    schedule: Schedule
    max_num_seqs: int
    measured: list[MeasuredPoint]
    commit: str
    host: str


def schedule_problem(schedule: Any) -> str | None:
    """Why ``schedule`` is not one vLLM accepts (the rules of its ``validate_and_normalize_dynamic_sd_schedule``,
    plus ranges given in order); None where it is one.

    The tests hold this check to vLLM's own parser on the same inputs, so a file is refused here, in one line, before
    a server spends a minute loading to refuse it in a traceback.
    """
    if not isinstance(schedule, list) or not schedule:
        return "expected a non-empty list of [first, last, K] ranges"
    previous_end = 0
    for entry in schedule:
        if (
            not isinstance(entry, list | tuple)
            or len(entry) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in entry)
        ):
            return f"{list(entry) if isinstance(entry, tuple) else entry!r}: each range is [first, last, K], integers"
        first, last, k = entry
        if first < 1 or first > last:
            return f"[{first}, {last}, {k}]: a range runs from a batch size of at least 1 to one no smaller"
        if k < 0:
            return f"[{first}, {last}, {k}]: K must be 0 (no speculation) or more"
        if first <= previous_end:
            return f"[{first}, {last}, {k}]: ranges must be sorted and must not overlap"
        previous_end = last
    if schedule[0][0] != 1:
        return f"the first range starts at {schedule[0][0]}: it must start at batch size 1"
    return None


def fit_schedule(schedule: Schedule, max_num_seqs: int | None) -> Schedule:
    """``schedule`` over batch sizes 1 to ``max_num_seqs`` exactly, the server's largest batch: ranges past it dropped,
    the last one ended there (vLLM carries the last range's K to max_num_seqs anyway, so this changes only what the
    line reads, never what the server does). None: the schedule as it is."""
    if max_num_seqs is None:
        return list(schedule)
    kept = [(first, min(last, max_num_seqs), k) for first, last, k in schedule if first <= max_num_seqs]
    first, _, k = kept[-1]
    return [*kept[:-1], (first, max_num_seqs, k)]


def k_at(schedule: Schedule, batch_size: int, k: int) -> int:
    """The K vLLM's scheduler takes at ``batch_size`` under ``schedule`` with ``num_speculative_tokens`` ``k``: the
    range's K, capped at ``k``; in a gap between ranges, or past the last, the K of the range before."""
    before = schedule[0][2]
    for first, last, range_k in schedule:
        if first > batch_size:
            break
        before = range_k
        if batch_size <= last:
            break
    return min(before, k)


def schedule_text(schedule: Schedule) -> str:
    """``K 2 at batch sizes 1-3, 0 at 4-128``: the schedule for people."""
    return "K " + ", ".join(
        f"{k} at {first}" if first == last else f"{k} at {first}-{last}" for first, last, k in schedule
    )


def point_text(point: MeasuredPoint) -> str:
    """``x1.08 (95% 1.03-1.13) at 1``: one measured figure for people."""
    interval = "no interval" if point.low is None else f"95% {point.low:.2f}-{point.high:.2f}"
    return f"x{point.speedup:.2f} ({interval}) at {point.concurrency}"


def write_schedule_record(
    path: Path,
    draft_dir: Path,
    k: int,
    schedule: Schedule,
    max_num_seqs: int,
    rule: str,
    measured: list[MeasuredPoint],
    details: dict[str, Any],
    commit: str,
    host: dict[str, Any],
) -> dict[str, Any]:
    """Writes the record atomically; returns it.

    Args:
        path: The record (``metrics/serve_schedule.json``).
        draft_dir: The draft measured.
        k: The K its server served at every batch size while measured.
        schedule: The schedule read from ``measured``; checked here, so no file vLLM would refuse is written.
        max_num_seqs: The measured server's largest batch; the last range ends there.
        rule: How the schedule was read from the figures, in words.
        measured: Per concurrency, the speed-up with its interval.
        details: How it was measured: baseline, rounds, prompts, requests, max_tokens, temperature, bench.
        commit: The checkout's commit.
        host: :func:`eaglenest.core.host.host_record`, with ``label`` (the host kind for people): kernels differ by
            host kind, and so does where speculation pays.
    """
    problem = schedule_problem([list(entry) for entry in schedule])
    if problem is not None:  # a derivation bug, not the user's: say what it made
        raise ValueError(f"not a schedule vLLM accepts: {schedule}: {problem}")
    record = {
        "draft": {"path": str(draft_dir), "sha256": draft_fingerprint(draft_dir)},
        "k": k,
        "schedule": [list(entry) for entry in fit_schedule(schedule, max_num_seqs)],
        "max_num_seqs": max_num_seqs,
        "rule": rule,
        "measured": [asdict(p) for p in measured],
        **details,
        "commit": commit,
        "host": host,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, record)
    return record


def read_schedule_record(path: Path) -> ScheduleRecord | None:
    """The record at ``path``; None where there is no file.

    Raises:
        InputFileError: the file is not a schedule record, or its schedule is one vLLM refuses (one line naming the
            file and the field).
    """
    if not path.is_file():
        return None
    try:
        document = json.loads(path.read_text())
        sha256 = document["draft"]["sha256"]
        k, schedule, max_num_seqs = document["k"], document["schedule"], document["max_num_seqs"]
        measured = [MeasuredPoint(**point) for point in document["measured"]]
        commit = str(document.get("commit", "unknown"))
        host = document.get("host") or {}
        host_label = str(host.get("label") or host.get("key") or "a host it does not record")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise InputFileError(
            f"{path}: not a serve schedule record ({type(err).__name__}: {err}); {REMEASURE_HINT}"
        ) from None
    if not isinstance(sha256, str):
        raise InputFileError(f"{path}: draft.sha256 is {sha256!r}, not a fingerprint; {REMEASURE_HINT}")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise InputFileError(f"{path}: k is {k!r}; expected the K measured, 1 or more; {REMEASURE_HINT}")
    if not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool) or max_num_seqs < 1:
        raise InputFileError(
            f"{path}: max_num_seqs is {max_num_seqs!r}; expected a batch size, 1 or more; {REMEASURE_HINT}"
        )
    problem = schedule_problem(schedule)
    if problem is not None:
        raise InputFileError(
            f"{path}: schedule {json.dumps(schedule)}: {problem} (vLLM's "
            f"num_speculative_tokens_per_batch_size); {REMEASURE_HINT}"
        )
    above = [entry for entry in schedule if entry[2] > k]
    if above:
        raise InputFileError(
            f"{path}: schedule range {above[0]} asks for more than k {k}, the K measured; {REMEASURE_HINT}"
        )
    return ScheduleRecord(sha256, k, [tuple(entry) for entry in schedule], max_num_seqs, measured, commit, host_label)


@dataclass(frozen=True)
class ScheduleChoice:
    """The schedule served (None: K at every batch size) and why, in words for the user."""

    schedule: Schedule | None
    why: str

    def line(self) -> str:
        if self.schedule is None:
            return f"K per batch size: none, the same K at every batch size ({self.why})"
        never = (
            "; it never speculates, and at K 0 the draft still runs a forward per step to keep its cache: "
            "`eaglenest serve --baseline none` serves plain decoding without it"
            if all(k == 0 for _, _, k in self.schedule)
            else ""
        )
        return f"K per batch size: {schedule_text(self.schedule)} ({self.why}){never}"


def served_schedule(
    draft_dir: Path, k: int, record_file: Path | None = SCHEDULE_FILE, explicit: bool = False, flag: str = "--schedule"
) -> ScheduleChoice:
    """The schedule to serve the draft with at K = ``k``: the record's, where it was measured on this very draft at
    this K; else none, with the reason.

    Args:
        draft_dir: The draft served.
        k: The K served (:func:`eaglenest.artifacts.k_record.served_k`): a schedule measured at another K says
            nothing about this one.
        record_file: The record; None: turned off (``--no-schedule``).
        explicit: The user named ``record_file``: then a missing file, or one measured on another draft or at
            another K, is refused (one line) rather than passed over.
        flag: The flag that names the record, for the messages.

    Raises:
        InputFileError: a file that is not a record, or (``explicit``) one that cannot be used for this draft.
    """
    if record_file is None:
        return ScheduleChoice(None, "--no-schedule")
    record = read_schedule_record(record_file)
    if record is None:
        if explicit:
            raise InputFileError(
                f"{flag} {record_file}: no such file; {MEASURE_HINT} (it writes {SCHEDULE_FILE}), or drop {flag}"
            )
        return ScheduleChoice(None, f"no {record_file}; {MEASURE_HINT}")
    why_not = None
    if record.sha256 != draft_fingerprint(draft_dir):
        why_not = f"{record_file} was measured on another draft; {MEASURE_HINT} for this one"
    elif record.k != k:
        why_not = (
            f"{record_file} was measured at K={record.k}, and K={k} is served; `eaglenest bench --serve "
            f"--num-speculative-tokens {k} --measure-schedule` measures one at K={k}"
        )
    if why_not is not None:
        if explicit:
            raise InputFileError(f"{flag} {why_not}, or drop {flag}")
        return ScheduleChoice(None, why_not)
    figures = ", ".join(point_text(p) for p in record.measured)
    return ScheduleChoice(
        record.schedule,
        f"measured for this draft by eaglenest bench at {record.commit} on "
        f"{record.host}, {record_file}: {figures or 'no figures'}",
    )
