"""The paired comparison of two revisions' evaluation records, per headline set, with a verdict per figure.

Per headline set (the sets of ``metrics/eval.json``) on the headline back end (``headline_backend`` of
``metrics/eval/details.json``), the turns both revisions decoded, matched by ``(id, turn)``, give tau and the
single-stream speed-up of each side, and a paired bootstrap over conversations gives the difference's 95% interval.
Prompt difficulty varies far more than a draft change moves tau, and pairing cancels it, so a paired interval is
much narrower than the two headline intervals side by side. A change is called ``better`` or ``worse`` only when
that interval excludes zero and the change exceeds the seed-to-seed spread recorded in ``docs/seed-spread.json``
(training the same configuration with another seed moves the figures too; that is not an effect of the change).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from eaglenest.artifacts.evaluation import cluster_sums
from eaglenest.commands.report.revisions import (
    DETAILS,
    EVAL_METRICS,
    RECORDS,
    Revision,
    headline_backend,
    headline_sets,
    host_key,
    load_seed_spread,
)
from eaglenest.core.bootstrap import Interval, Statistic, bootstrap, difference, speedup_statistic, tau_statistic

# the evaluate stage's defaults (evaluate.bootstrap_samples, evaluate.seed): the same records give the same
# intervals in the report as in details.json
DEFAULT_SAMPLES = 2000
DEFAULT_SEED = 0
MIN_SAMPLES = 100
NO_SPREAD = "no seed spread recorded"
# A change without a recorded spread, or between revisions from two host kinds, is shown and never judged.
NO_VERDICT = "no verdict"
OTHER_HOST = "no verdict (another host kind)"
TAU_FIELDS = ("accepted", "steps")
SPEEDUP_FIELDS = ("spec_tokens", "spec_s", "plain_tokens", "plain_s")
# The verdict's figure: the draft's tokens/s over the n-gram baseline's on the same timed turns.
VERSUS_FIELDS = ("spec_tokens", "spec_s", "ngram_tokens", "ngram_s")
# The seed spreads are max - min of headline figures rounded to 4 decimals, so each is within 1e-4 of the
# unrounded spread; the paired change is recomputed from unrounded records.
SPREAD_ROUNDING = 1e-4


def verdict(diff: Interval, spread: float | None) -> str:
    """``better``/``worse`` when the paired interval excludes zero and the change exceeds the seed spread;
    ``within seed spread`` when only the first holds; :data:`NO_VERDICT` when it does and no spread is recorded
    (a seed alone may move a figure that far); else ``no change``.

    The change is compared at the spread's precision: a retrained seed's own change, recomputed from its
    records, must not exceed the spread it defines by a rounding."""
    if not diff.excludes_zero():
        return "no change"
    if spread is None:
        return NO_VERDICT
    if abs(diff.value) <= (spread + SPREAD_ROUNDING if spread else 0.0):
        return "within seed spread"
    return "better" if diff.value > 0 else "worse"


@dataclass(frozen=True)
class PairedFigure:
    """One figure of one set, base against head on the turns both decoded.

    Attributes:
        name: What the report calls it (tau, speed-up).
        metric: Its name in metrics/eval.json and docs/seed-spread.json (``vllm_tau``).
        base: The base revision's figure on the paired turns.
        head: The head revision's figure on the same turns.
        difference: Head minus base with its paired bootstrap interval.
        spread: The recorded seed-to-seed spread of the figure; None where none is recorded.
        other_host: The two revisions ran on different host kinds: shown, never judged.
    """

    name: str
    metric: str
    base: float
    head: float
    difference: Interval
    spread: float | None
    other_host: bool = False

    @property
    def verdict(self) -> str:
        """``better``/``worse``, ``within seed spread``, ``no change`` or no verdict; see :func:`verdict`."""
        return OTHER_HOST if self.other_host else verdict(self.difference, self.spread)


@dataclass(frozen=True)
class SetComparison:
    """A headline set compared between two revisions.

    Attributes:
        set_name: The set.
        backend: The back end whose records were paired.
        refused: Why the set was not paired (one line), else None.
        pairs: Turns both revisions decoded.
        conversations: Conversations those turns belong to (the bootstrap's units).
        timed_pairs: Paired turns timed in both revisions.
        figures: tau, and the speed-up where turns were timed in both.
    """

    set_name: str
    backend: str
    refused: str | None = None
    pairs: int = 0
    conversations: int = 0
    timed_pairs: int = 0
    figures: tuple[PairedFigure, ...] = ()


@dataclass(frozen=True)
class RevisionComparison:
    """One head against base: what was paired, on which back end, against which seed spread.

    Attributes:
        base: The base revision's name.
        head: The head revision's name.
        same: The abbreviated commit where both names are one revision (nothing compared), else None.
        missing: The files whose absence stopped the comparison (``rev:path``); empty where it ran.
        backend: The headline back end of head, whose records were paired.
        base_backend: The headline back end of base (said where it differs).
        spread_at: The revision whose ``docs/seed-spread.json`` was read.
        has_spreads: Whether a seed spread was recorded there.
        hosts: The host kind's key per revision name; None where evaluate recorded none.
        sets: Every headline set of either revision, compared or with the reason it was not.
    """

    base: str
    head: str
    same: str | None = None
    missing: tuple[str, ...] = ()
    backend: str = ""
    base_backend: str = ""
    spread_at: str = ""
    has_spreads: bool = False
    hosts: tuple[tuple[str, str | None], ...] = ()
    sets: tuple[SetComparison, ...] = ()

    @property
    def other_host(self) -> bool:
        """Both revisions recorded a host kind and the two differ: kernels differ, so nothing is judged."""
        keys = [key for _, key in self.hosts]
        return None not in keys and len(set(keys)) > 1


def _key(record: dict[str, Any]) -> tuple[str, int]:
    return str(record["id"]), int(record["turn"])


def pair_records(base: list[dict[str, Any]], head: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The (base, head) records of the turns both decoded, matched by (id, turn), in base's order."""
    by_key = {_key(record): record for record in head}
    return [(record, by_key[_key(record)]) for record in base if _key(record) in by_key]


def _is_timed(record: dict[str, Any]) -> bool:
    return record.get("spec_s") is not None and record.get("plain_s") is not None


def paired_interval(
    pairs: list[tuple[dict[str, Any], dict[str, Any]]],
    fields: tuple[str, ...],
    statistic: Statistic,
    samples: int,
    seed: int,
) -> tuple[float, float, Interval]:
    """(base figure, head figure, head minus base with its interval) on the paired turns.

    A conversation's turns are summed into one unit on both sides, and each resample draws the same units for
    base and head, so what both share (which prompts are hard) cancels in the difference.
    """
    merged = [
        {"id": base["id"], **{f"base.{f}": base[f] for f in fields}, **{f"head.{f}": head[f] for f in fields}}
        for base, head in pairs
    ]
    width = len(fields)
    sums = cluster_sums(merged, tuple(f"base.{f}" for f in fields) + tuple(f"head.{f}" for f in fields))
    totals = sums.sum(0)
    diff = bootstrap(sums, difference(statistic, width), samples, seed)
    return float(statistic(totals[:width])), float(statistic(totals[width:])), diff


def _run_and_set(
    document: dict[str, Any], backend: str, set_name: str, label: str
) -> tuple[dict[str, Any] | None, dict[str, Any] | None, str | None]:
    run = document["runs"].get(backend)
    if not isinstance(run, dict):
        return None, None, f"{label} has no {backend} records"
    entry = (run.get("sets") or {}).get(set_name)
    if not isinstance(entry, dict):
        return None, None, f"{label} has no {backend} records of set {set_name}"
    return run, entry, None


def _settings_differ(
    base: tuple[dict[str, Any], dict[str, Any], dict[str, Any]],
    head: tuple[dict[str, Any], dict[str, Any], dict[str, Any]],
) -> list[str]:
    """What the two decoded differently (K, dtype, temperature, max_new_tokens), from (records, run, set) each."""

    def settings(records: dict[str, Any], run: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
        return {
            "K": run.get("num_speculative_tokens", records["num_speculative_tokens"]),
            "dtype": run.get("dtype"),
            "temperature": entry.get("temperature"),
            "max_new_tokens": entry.get("max_new_tokens"),
        }

    ours, theirs = settings(*base), settings(*head)
    return [f"{name} {ours[name]} against {theirs[name]}" for name in ours if ours[name] != theirs[name]]


def compare_set(
    base_records: dict[str, Any],
    head_records: dict[str, Any],
    set_name: str,
    backend: str,
    spreads: dict[str, float],
    samples: int,
    seed: int,
    labels: tuple[str, str] = ("base", "head"),
    other_host: bool = False,
) -> SetComparison:
    """Pairs one set's records of two revisions (load_records documents) and compares tau, speed-up and the draft's
    speed over the n-gram baseline's.

    Args:
        base_records: The base revision's records.json.
        head_records: The head revision's records.json.
        set_name: The set.
        backend: The back end to pair (its metric names start with it).
        spreads: This set's recorded seed spread per metric name (``vllm_tau``); a missing name has none.
        samples: Bootstrap resamples.
        seed: Seed of the resampling.
        labels: How the report names base and head.
        other_host: The two ran on different host kinds: figures are shown, never judged.

    Returns:
        The comparison, or one with ``refused`` set where the records cannot be paired: a side lacks the set,
        the two were decoded with a different K, dtype, temperature or max_new_tokens, or they share no turn.
    """
    base_run, base_set, missing = _run_and_set(base_records, backend, set_name, labels[0])
    if missing is None:
        head_run, head_set, missing = _run_and_set(head_records, backend, set_name, labels[1])
    if missing is not None:
        return SetComparison(set_name, backend, refused=f"Not paired: {missing}")
    differ = _settings_differ((base_records, base_run, base_set), (head_records, head_run, head_set))
    if differ:
        return SetComparison(
            set_name,
            backend,
            refused=f"Not paired: the revisions decoded it differently "
            f"({labels[0]} against {labels[1]}: {'; '.join(differ)})",
        )
    pairs = pair_records(base_set.get("records", []), head_set.get("records", []))
    if not pairs:
        return SetComparison(
            set_name,
            backend,
            refused=f"Not paired: {labels[0]} and {labels[1]} share no "
            "decoded turn (no record with the same id and turn)",
        )
    figures = [
        PairedFigure(
            "tau",
            f"{backend}_tau",
            *paired_interval(pairs, TAU_FIELDS, tau_statistic, samples, seed),
            spreads.get(f"{backend}_tau"),
            other_host,
        )
    ]
    timed = [(b, h) for b, h in pairs if _is_timed(b) and _is_timed(h)]
    if timed:
        figures.append(
            PairedFigure(
                "speed-up",
                f"{backend}_speedup",
                *paired_interval(timed, SPEEDUP_FIELDS, speedup_statistic, samples, seed),
                spreads.get(f"{backend}_speedup"),
                other_host,
            )
        )
    versus = [(b, h) for b, h in timed if b.get("ngram_s") is not None and h.get("ngram_s") is not None]
    if versus:
        figures.append(
            PairedFigure(
                "draft / n-gram",
                f"{backend}_vs_ngram",
                *paired_interval(versus, VERSUS_FIELDS, speedup_statistic, samples, seed),
                spreads.get(f"{backend}_vs_ngram"),
                other_host,
            )
        )
    return SetComparison(
        set_name,
        backend,
        pairs=len(pairs),
        conversations=len({str(b["id"]) for b, _ in pairs}),
        timed_pairs=len(timed),
        figures=tuple(figures),
    )


def compare_revisions(base: Revision, head: Revision, samples: int, seed: int) -> RevisionComparison:
    """Every headline set present in either revision, head against base; see :class:`RevisionComparison`."""
    if head.identity == base.identity:
        return RevisionComparison(base.rev, head.rev, same=head.short)
    sets_base, sets_head = headline_sets(base.read_json(EVAL_METRICS)), headline_sets(head.read_json(EVAL_METRICS))
    records = {revision.rev: revision.records() for revision in (base, head)}
    missing = [f"{rev}:{RECORDS}" for rev, document in records.items() if document is None]
    missing += [
        f"{rev}:{EVAL_METRICS} (headline sets)"
        for rev, sets in ((base.rev, sets_base), (head.rev, sets_head))
        if not sets
    ]
    if missing:
        return RevisionComparison(base.rev, head.rev, missing=tuple(missing))
    base_records, head_records = records[base.rev], records[head.rev]
    # The spread is measured once for the project: an experiment branched before it was recorded reads base's.
    spread_at, spreads = head, load_seed_spread(head)
    if spreads is None:
        spread_at, spreads = base, load_seed_spread(base) or {}
    comparison = RevisionComparison(
        base.rev,
        head.rev,
        backend=headline_backend(head.read_json(DETAILS), head_records),
        base_backend=headline_backend(base.read_json(DETAILS), base_records),
        spread_at=spread_at.rev,
        has_spreads=bool(spreads),
        hosts=tuple((r.rev, host_key(r.read_json(DETAILS))) for r in (base, head)),
    )
    compared = []
    for set_name in sets_head + [name for name in sets_base if name not in sets_head]:
        if set_name not in sets_base or set_name not in sets_head:
            where = base.rev if set_name in sets_base else head.rev
            compared.append(
                SetComparison(set_name, comparison.backend, refused=f"Not paired: a headline set only at {where}.")
            )
            continue
        compared.append(
            compare_set(
                base_records,
                head_records,
                set_name,
                comparison.backend,
                spreads.get(set_name, {}),
                samples,
                seed,
                (base.rev, head.rev),
                comparison.other_host,
            )
        )
    return replace(comparison, sets=tuple(compared))
