"""``eaglenest report BASE [HEAD ...]``: how revisions differ, as Markdown with PNG plots next to it.

The report has three parts:

* the headline table: every metric of the metrics files dvc.yaml declares, base against each head;
* the paired comparison, per headline set (the sets of ``metrics/eval.json``) on the headline back end
  (``headline_backend`` of ``metrics/eval/details.json``): the turns both revisions decoded, matched by
  ``(id, turn)``, give tau and the single-stream speed-up of each side, and a paired bootstrap over
  conversations gives the difference's 95% interval. Prompt difficulty varies far more than a draft change
  moves tau, and pairing cancels it, so a paired interval is much narrower than the two headline intervals
  side by side. A change is called ``better`` or ``worse`` only when that interval excludes zero and the
  change exceeds the seed-to-seed spread recorded in ``docs/seed-spread.json`` (training the same
  configuration with another seed moves the figures too; that is not an effect of the change);
* plots: acceptance per draft position (EAGLE-3 against n-gram), tau per category with its interval, and the
  training against the validation loss.

DVC's ``dvc plots diff`` writes HTML that loads Vega from a CDN, so it is blank offline and in many CI viewers;
the plots here are PNG files drawn with matplotlib.

Revisions are git revisions (branch, tag, commit), DVC experiment names (``dvc exp show`` lists them), or
``workspace``. Everything is read at each revision with ``git show`` from files git tracks (the declared metrics,
the evaluate stage's records and details: ``cache: false``); dvclive's curves and the stages' bookkeeping metrics are
cached DVC outputs, read at a revision from the DVC cache or, where it lacks them, the default remote.
"""

from __future__ import annotations

import io
import json
import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from eaglenest.artifacts.evaluation import cluster_sums, load_records
from eaglenest.core.atomic import atomic_write_bytes
from eaglenest.core.bootstrap import Interval, Statistic, bootstrap, difference, speedup_statistic, tau_statistic
from eaglenest.core.errors import EaglenestError, InputFileError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

WORKSPACE = "workspace"
EVAL_METRICS = "metrics/eval.json"
RECORDS = "metrics/eval/records.json"
DETAILS = "metrics/eval/details.json"
log = logging.getLogger(__name__)
SEED_SPREAD = "docs/seed-spread.json"
TRAIN_LOSS = "dvclive/train/plots/metrics/train/loss.tsv"
VAL_LOSS = "dvclive/train/plots/metrics/val/loss.tsv"
CURVES = {
    "val_accuracy": ("Validation accuracy per TTT step",
                     [f"dvclive/train/plots/metrics/val/acc_{i}.tsv" for i in range(8)]),
    "tau_sim": ("Simulated acceptance length (tau_sim)", ["dvclive/train/plots/metrics/val/tau_sim.tsv"]),
}
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


class Revision:
    """Reads files of one revision of the repository (or the workspace).

    Attributes:
        repo: The repository.
        rev: The name it was given.
        ref: What ``git show`` reads (a commit-ish or an experiment's ref); None for the workspace.
        identity: The commit it resolves to, or ``workspace``: two names with one identity are one revision.
    """

    def __init__(self, repo: Path, rev: str) -> None:
        self.repo, self.rev = repo, rev
        self._outputs: Any = None  # the revision's DVC outputs (a DVCFileSystem), opened on the first need
        self.ref = None if rev == WORKSPACE else self._resolve(rev)
        self.identity = WORKSPACE
        if self.ref is not None:
            self.identity = self._git("rev-parse", f"{self.ref}^{{commit}}").stdout.strip()

    def _git(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], cwd=self.repo, capture_output=True, text=True)

    def _resolve(self, rev: str) -> str:
        if self._git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").returncode == 0:
            return rev
        refs = self._git("for-each-ref", "--format=%(refname)", "refs/exps").stdout.split()
        matches = [ref for ref in refs if ref.rsplit("/", 1)[-1] == rev]
        if len(matches) == 1:
            return matches[0]
        raise EaglenestError(f"revision {rev!r}: not a git revision, DVC experiment or 'workspace'")

    @property
    def short(self) -> str:
        """The identity as a reader quotes it (an abbreviated commit)."""
        return self.identity if self.identity == WORKSPACE else self.identity[:10]

    def read(self, path: str) -> str | None:
        """The file's text at this revision, or None where it does not exist there."""
        if self.ref is None:
            file = self.repo / path
            return file.read_text() if file.is_file() else None
        shown = self._git("show", f"{self.ref}:{path}")
        return shown.stdout if shown.returncode == 0 else self._read_output(path)

    def _read_output(self, path: str) -> str | None:
        """A file of a cached DVC output at this revision (the bookkeeping metrics and dvclive's curves leave git
        so that DVC's run-cache restores their stages): from the local cache, else the default remote; None where
        neither has it."""
        from dvc.api import DVCFileSystem
        from dvc.exceptions import DvcException

        if self._outputs is False:
            return None
        try:
            if self._outputs is None:
                self._outputs = DVCFileSystem(str(self.repo), rev=self.identity)
            return self._outputs.read_text(path) if self._outputs.isfile(path) else None
        except (DvcException, OSError) as err:  # not a DVC repository, no remote, an object missing everywhere
            if self._outputs is None:
                self._outputs = False  # asked once per revision
            log.debug("%s:%s: not read from DVC (%s)", self.rev, path, err)
            return None

    def read_json(self, path: str) -> Any:
        """The file parsed as JSON, or None where it does not exist.

        Raises:
            InputFileError: The file exists but is not JSON.
        """
        text = self.read(path)
        if text is None:
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise InputFileError(f"{self.rev}:{path}: not valid JSON: {err.msg} (line {err.lineno})") from None


def flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    """Nested metrics as flat names: ``train.val_acc.0`` (lists get their index)."""
    if isinstance(value, dict):
        for key, item in value.items():
            flatten(f"{prefix}.{key}" if prefix else str(key), item, out)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            flatten(f"{prefix}.{i}", item, out)
    else:
        out[prefix] = value


def metric_files(revisions: list[Revision]) -> list[str]:
    """The metrics files the revisions' dvc.yaml declare, in stage order (a file any of them declares counts)."""
    files: list[str] = []
    for revision in revisions:
        text = revision.read("dvc.yaml")
        try:
            document = yaml.safe_load(text) if text else None
        except yaml.YAMLError as err:
            raise InputFileError(f"{revision.rev}:dvc.yaml: not valid YAML: {err}") from None
        stages = document.get("stages") if isinstance(document, dict) else None
        for stage in (stages or {}).values():
            for entry in stage.get("metrics", []) if isinstance(stage, dict) else []:
                path = next(iter(entry)) if isinstance(entry, dict) else entry
                if path not in files:
                    files.append(path)
    return files


def read_metrics(revision: Revision, files: list[str]) -> dict[str, Any]:
    """The revision's metrics, flattened; a file absent at the revision contributes nothing."""
    metrics: dict[str, Any] = {}
    for path in files:
        value = revision.read_json(path)
        if value is not None:
            flatten(Path(path).stem, value, metrics)
    return metrics


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "—" if value is None else str(value)


def metrics_table(base: str, revisions: list[str], values: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown rows: metric, base value, each revision's value and its change; changed metrics first."""
    names = sorted({name for v in values.values() for name in v})
    if not names:
        return ["(no declared metrics at these revisions)"]
    header = ["metric", base, *[f"{rev} (change)" for rev in revisions]]
    changed, unchanged = [], []
    for name in names:
        base_value = values[base].get(name)
        cells, differs = [], False
        for rev in revisions:
            value = values[rev].get(name)
            differs |= value != base_value
            numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (value, base_value))
            if numeric and value != base_value:
                cells.append(f"{_format(value)} ({value - base_value:+.4g})")
            else:
                cells.append(_format(value))
        (changed if differs else unchanged).append(f"| {name} | {_format(base_value)} | {' | '.join(cells)} |")
    rows = [f"| {' | '.join(header)} |", "|" + "---|" * len(header)]
    return rows + changed + unchanged


# ---------------------------------------------------------------------------------------------------------------
# The paired comparison


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


def _key(record: dict[str, Any]) -> tuple[str, int]:
    return str(record["id"]), int(record["turn"])


def pair_records(base: list[dict[str, Any]], head: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The (base, head) records of the turns both decoded, matched by (id, turn), in base's order."""
    by_key = {_key(record): record for record in head}
    return [(record, by_key[_key(record)]) for record in base if _key(record) in by_key]


def _is_timed(record: dict[str, Any]) -> bool:
    return record.get("spec_s") is not None and record.get("plain_s") is not None


def paired_interval(pairs: list[tuple[dict[str, Any], dict[str, Any]]], fields: tuple[str, ...],
                    statistic: Statistic, samples: int, seed: int) -> tuple[float, float, Interval]:
    """(base figure, head figure, head minus base with its interval) on the paired turns.

    A conversation's turns are summed into one unit on both sides, and each resample draws the same units for
    base and head, so what both share (which prompts are hard) cancels in the difference.
    """
    merged = [{"id": base["id"], **{f"base.{f}": base[f] for f in fields}, **{f"head.{f}": head[f] for f in fields}}
              for base, head in pairs]
    width = len(fields)
    sums = cluster_sums(merged, tuple(f"base.{f}" for f in fields) + tuple(f"head.{f}" for f in fields))
    totals = sums.sum(0)
    diff = bootstrap(sums, difference(statistic, width), samples, seed)
    return float(statistic(totals[:width])), float(statistic(totals[width:])), diff


def _run_and_set(document: dict[str, Any], backend: str, set_name: str, label: str
                 ) -> tuple[dict[str, Any] | None, dict[str, Any] | None, str | None]:
    run = document["runs"].get(backend)
    if not isinstance(run, dict):
        return None, None, f"{label} has no {backend} records"
    entry = (run.get("sets") or {}).get(set_name)
    if not isinstance(entry, dict):
        return None, None, f"{label} has no {backend} records of set {set_name}"
    return run, entry, None


def compare_set(base_records: dict[str, Any], head_records: dict[str, Any], set_name: str, backend: str,
                spreads: dict[str, float], samples: int, seed: int, labels: tuple[str, str] = ("base", "head"),
                other_host: bool = False) -> SetComparison:
    """Pairs one set's records of two revisions (load_records documents) and compares tau and speed-up.

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
    settings = {
        "K": (base_run.get("num_speculative_tokens", base_records["num_speculative_tokens"]),
              head_run.get("num_speculative_tokens", head_records["num_speculative_tokens"])),
        "dtype": (base_run.get("dtype"), head_run.get("dtype")),
        "temperature": (base_set.get("temperature"), head_set.get("temperature")),
        "max_new_tokens": (base_set.get("max_new_tokens"), head_set.get("max_new_tokens")),
    }
    differ = [f"{name} {b} against {h}" for name, (b, h) in settings.items() if b != h]
    if differ:
        return SetComparison(set_name, backend, refused=f"Not paired: the revisions decoded it differently "
                             f"({labels[0]} against {labels[1]}: {'; '.join(differ)})")
    pairs = pair_records(base_set.get("records", []), head_set.get("records", []))
    if not pairs:
        return SetComparison(set_name, backend, refused=f"Not paired: {labels[0]} and {labels[1]} share no "
                             "decoded turn (no record with the same id and turn)")
    figures = [PairedFigure("tau", f"{backend}_tau", *paired_interval(pairs, TAU_FIELDS, tau_statistic, samples,
                                                                      seed), spreads.get(f"{backend}_tau"), other_host)]
    timed = [(b, h) for b, h in pairs if _is_timed(b) and _is_timed(h)]
    if timed:
        figures.append(PairedFigure("speed-up", f"{backend}_speedup",
                                    *paired_interval(timed, SPEEDUP_FIELDS, speedup_statistic, samples, seed),
                                    spreads.get(f"{backend}_speedup"), other_host))
    return SetComparison(set_name, backend, pairs=len(pairs), conversations=len({str(b["id"]) for b, _ in pairs}),
                         timed_pairs=len(timed), figures=tuple(figures))


def comparison_lines(comparison: SetComparison, base_label: str, head_label: str) -> list[str]:
    """One set's Markdown: a line saying what was paired, then base, head, difference and verdict per figure."""
    lines = [f"### {comparison.set_name}", ""]
    if comparison.refused:
        return [*lines, comparison.refused, ""]
    lines += [f"{comparison.pairs} turns of {comparison.conversations} conversations paired; "
              f"{comparison.timed_pairs} of them timed in both.", "",
              f"| figure | {base_label} | {head_label} | difference [95% interval] | seed spread | verdict |",
              "|---|---|---|---|---|---|"]
    for figure in comparison.figures:
        diff = figure.difference
        spread = NO_SPREAD if figure.spread is None else f"{figure.spread:.3g}"
        lines.append(f"| {figure.name} | {figure.base:.3f} | {figure.head:.3f} | "
                     f"{diff.value:+.3f} [{diff.low:+.3f}, {diff.high:+.3f}] | {spread} | {figure.verdict} |")
    if not comparison.timed_pairs:
        lines.append("| speed-up | — | — | no turn timed in both | — | — |")
    return [*lines, ""]


def headline_sets(metrics: Any) -> list[str]:
    """The set names of a metrics/eval.json (its keys that hold a set's figures)."""
    return [name for name, value in metrics.items() if isinstance(value, dict)] if isinstance(metrics, dict) else []


def headline_backend(details: Any, records: dict[str, Any]) -> str:
    """details.json's headline back end; without details, vllm where recorded (the serving back end), else the
    only back end recorded."""
    if isinstance(details, dict) and isinstance(details.get("headline_backend"), str):
        return details["headline_backend"]
    backends = list(records["runs"])
    return "vllm" if "vllm" in backends or not backends else backends[0]


def load_seed_spread(revision: Revision) -> dict[str, dict[str, float]] | None:
    """``docs/seed-spread.json``'s figures at the revision: ``{set: {metric: spread}}``; None where absent.

    Raises:
        InputFileError: The file is not ``{"figures": {set: {metric: number >= 0}}}``.
    """
    document = revision.read_json(SEED_SPREAD)
    if document is None:
        return None
    where = f"{revision.rev}:{SEED_SPREAD}"
    figures = document.get("figures") if isinstance(document, dict) else None
    if not isinstance(figures, dict):
        raise InputFileError(f"{where}: expected {{'figures': {{set: {{metric: spread}}}}}}")
    for set_name, entry in figures.items():
        if not isinstance(entry, dict):
            raise InputFileError(f"{where}: figures.{set_name}: expected {{metric: spread}}")
        for metric, spread in entry.items():
            if isinstance(spread, bool) or not isinstance(spread, (int, float)) or spread < 0:
                raise InputFileError(f"{where}: figures.{set_name}.{metric} = {spread!r}: expected a number >= 0")
    return figures


def _records(revision: Revision) -> dict[str, Any] | None:
    text = revision.read(RECORDS)
    return None if text is None else load_records(text, f"{revision.rev}:{RECORDS}")


def host_key(details: Any) -> str | None:
    """The host kind's key evaluate recorded in details.json; None where it recorded none."""
    host = details.get("host") if isinstance(details, dict) else None
    return host.get("key") if isinstance(host, dict) and isinstance(host.get("key"), str) else None


def paired_section(base: Revision, head: Revision, samples: int, seed: int) -> list[str]:
    """The Markdown of one head against base: every headline set present in either revision."""
    lines = [f"## Paired comparison: {head.rev} against {base.rev}", ""]
    if head.identity == base.identity:
        return [*lines, f"{head.rev} and {base.rev} are the same revision ({head.short}): nothing to compare.", ""]
    sets_base, sets_head = headline_sets(base.read_json(EVAL_METRICS)), headline_sets(head.read_json(EVAL_METRICS))
    records = {revision.rev: _records(revision) for revision in (base, head)}
    missing = [f"{rev}:{RECORDS}" for rev, document in records.items() if document is None]
    if not sets_base or not sets_head or missing:
        absent = missing + [f"{rev}:{EVAL_METRICS} (headline sets)" for rev, sets in
                            ((base.rev, sets_base), (head.rev, sets_head)) if not sets]
        return [*lines, f"Not paired: missing {', '.join(absent)}.", ""]
    base_records, head_records = records[base.rev], records[head.rev]
    backend = headline_backend(head.read_json(DETAILS), head_records)
    base_backend = headline_backend(base.read_json(DETAILS), base_records)
    # The spread is measured once for the project: an experiment branched before it was recorded reads base's.
    spread_at, spreads = head, load_seed_spread(head)
    if spreads is None:
        spread_at, spreads = base, load_seed_spread(base) or {}
    lines += [f"Back end: {backend} (the headline back end of {head.rev}"
              + (f"; {base.rev}'s is {base_backend}" if base_backend != backend else "") + "). "
              "Each figure is recomputed on the turns both revisions decoded (same id and turn); the interval of "
              f"the difference is a paired bootstrap over conversations ({samples} resamples, seed {seed}). A change "
              "is better or worse when that interval excludes zero and the change exceeds the seed-to-seed spread "
              f"recorded in {SEED_SPREAD} at {spread_at.rev}"
              + ("" if spreads else f" ({NO_SPREAD}: {NO_VERDICT} on any change)") + ".", ""]
    hosts = {revision.rev: host_key(revision.read_json(DETAILS)) for revision in (base, head)}
    other_host = None not in hosts.values() and hosts[base.rev] != hosts[head.rev]
    if other_host:
        lines += [f"Host kinds differ ({base.rev}: {hosts[base.rev]}; {head.rev}: {hosts[head.rev]}): kernels "
                  "differ by host kind, so the figures are shown and neither revision is called better or worse.", ""]
    for set_name in sets_head + [name for name in sets_base if name not in sets_head]:
        if set_name not in sets_base or set_name not in sets_head:
            where = base.rev if set_name in sets_base else head.rev
            lines += [f"### {set_name}", "", f"Not paired: a headline set only at {where}.", ""]
            continue
        comparison = compare_set(base_records, head_records, set_name, backend, spreads.get(set_name, {}),
                                 samples, seed, (base.rev, head.rev), other_host)
        lines += comparison_lines(comparison, base.rev, head.rev)
    return lines


# ---------------------------------------------------------------------------------------------------------------
# Plots: functions that build a Figure (tests read their axes) and one that saves them


def _colors(count: int) -> list[Any]:
    from matplotlib import colormaps

    palette = colormaps["tab10"]
    return [palette(i % 10) for i in range(count)]


def _run_sets(details: Any, backend: str) -> dict[str, Any]:
    if not isinstance(details, dict):
        return {}
    run = (details.get("runs") or {}).get(backend)
    return (run.get("sets") or {}) if isinstance(run, dict) else {}


def _panels(set_names: list[str], width: float = 4.6, height: float = 3.8) -> tuple[Figure, list[Any]]:
    from matplotlib.figure import Figure

    # a Figure without pyplot: no global state, no display, and savefig renders with Agg
    fig = Figure(figsize=(width * len(set_names), height), layout="constrained")
    return fig, list(fig.subplots(1, len(set_names), squeeze=False)[0])


def _ordered_union(groups: list[list[str]]) -> list[str]:
    seen: list[str] = []
    for group in groups:
        seen += [name for name in group if name not in seen]
    return seen


def acceptance_figure(series: list[tuple[str, Any]], backend: str) -> Figure | None:
    """Acceptance rate per draft position, EAGLE-3 against n-gram per revision, one panel per set.

    Args:
        series: (label, details.json document) per distinct revision.
        backend: The back end whose sets are drawn.

    Returns:
        The figure, or None where no revision has acceptance figures for the back end.
    """
    sets = _ordered_union([list(_run_sets(details, backend)) for _, details in series])
    sets = [name for name in sets if any("per_position_acceptance" in _run_sets(d, backend).get(name, {}).get(
        "summary", {}) for _, d in series)]
    if not sets:
        return None
    fig, axes = _panels(sets)
    colors = _colors(len(series))
    bars = 2 * len(series)
    width = 0.8 / bars
    for ax, set_name in zip(axes, sets, strict=True):
        positions = 0
        for i, (label, details) in enumerate(series):
            summary = _run_sets(details, backend).get(set_name, {}).get("summary", {})
            for j, (drafter, key, style) in enumerate((
                    ("EAGLE-3", "per_position_acceptance", {}),
                    ("n-gram", "ngram_per_position_acceptance", {"hatch": "//", "alpha": 0.45}))):
                rates = summary.get(key)
                if not rates:
                    continue
                positions = max(positions, len(rates))
                offset = (2 * i + j - (bars - 1) / 2) * width
                ax.bar([p + 1 + offset for p in range(len(rates))], rates, width, color=colors[i],
                       edgecolor=colors[i], label=f"{label}: {drafter}", **style)
        ax.set_xticks(range(1, positions + 1))
        ax.set_ylim(0, 1)
        _label_panel(ax, f"{set_name} ({backend})", "draft position", "acceptance rate")
    fig.suptitle("Acceptance rate per draft position: EAGLE-3 against n-gram")
    return fig


def _label_panel(ax: Any, title: str, xlabel: str, ylabel: str) -> None:
    """A bar panel's title, axis labels, grid and legend, the same on every panel."""
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)


def tau_category_figure(series: list[tuple[str, Any]], backend: str) -> Figure | None:
    """tau per category with its 95% interval as error bars, one panel per set, the K+1 bound drawn.

    The first group of each panel (``all``) is the set's tau, so a set without categories still gets a panel.

    Args:
        series: (label, details.json document) per distinct revision.
        backend: The back end whose sets are drawn.

    Returns:
        The figure, or None where no revision has a tau for the back end.
    """
    sets = [name for name in _ordered_union([list(_run_sets(d, backend)) for _, d in series])
            if any("tau" in _run_sets(d, backend).get(name, {}).get("summary", {}) for _, d in series)]
    if not sets:
        return None
    bounds = sorted({details["num_speculative_tokens"] + 1 for _, details in series
                     if isinstance(details, dict) and isinstance(details.get("num_speculative_tokens"), int)})
    fig, axes = _panels(sets, width=5.2)
    colors = _colors(len(series))
    width = 0.8 / len(series)
    for ax, set_name in zip(axes, sets, strict=True):
        summaries = [_run_sets(d, backend).get(set_name, {}).get("summary", {}) for _, d in series]
        categories = ["all", *_ordered_union([list(s.get("categories", {})) for s in summaries])]
        for i, ((label, _), summary) in enumerate(zip(series, summaries, strict=True)):
            figures = {"all": summary.get("tau"), **summary.get("categories", {})}
            xs, values, low, high = [], [], [], []
            for x, category in enumerate(categories):
                figure = figures.get(category)
                if figure:
                    xs.append(x + (i - (len(series) - 1) / 2) * width)
                    values.append(figure["value"])
                    low.append(figure["value"] - figure["low"])
                    high.append(figure["high"] - figure["value"])
            ax.bar(xs, values, width, yerr=[low, high], capsize=3, color=colors[i], label=label)
        for bound in bounds:
            ax.axhline(bound, color="black", linestyle="--", linewidth=1, label=f"K+1 = {bound} (every draft accepted)")
        ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right", fontsize=8)
        if bounds:
            ax.set_ylim(0, max(bounds) * 1.08)
        _label_panel(ax, f"{set_name} ({backend})", "category", "tau (tokens per verify step)")
    fig.suptitle("tau per category with its 95% interval")
    return fig


def _series(text: str) -> tuple[list[float], list[float]]:
    """A dvclive TSV's steps and values (the column after ``step``, ignoring a ``timestamp`` column)."""
    lines = [line.split("\t") for line in text.splitlines() if line.strip()]
    header, rows = lines[0], lines[1:]
    step = header.index("step") if "step" in header else 0
    value = next(i for i in range(len(header) - 1, -1, -1) if header[i] not in ("step", "timestamp"))
    return [float(row[step]) for row in rows], [float(row[value]) for row in rows]


def loss_figure(series: list[tuple[str, str | None, str | None]]) -> Figure | None:
    """Training loss (solid) against validation loss (dashed, markers) over steps, one colour per revision.

    Args:
        series: (label, train loss TSV text, validation loss TSV text) per distinct revision; None where absent.

    Returns:
        The figure, or None where no revision has a loss curve.
    """
    if not any(train or val for _, train, val in series):
        return None
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    for color, (label, train, val) in zip(_colors(len(series)), series, strict=True):
        if train:
            ax.plot(*_series(train), color=color, linewidth=1, label=f"{label}: training")
        if val:
            ax.plot(*_series(val), color=color, linestyle="--", marker="o", markersize=3, label=f"{label}: validation")
    values = [v for line in ax.get_lines() for v in line.get_ydata()]
    if values and min(values) > 0 and max(values) > 10 * min(values):
        ax.set_yscale("log")  # early losses are tens of times the late ones, which a linear axis flattens
    ax.set_title("Training against validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def curve_figure(title: str, series: list[tuple[str, list[tuple[str, str]]]]) -> Figure | None:
    """dvclive curves over steps: per revision, (curve name, TSV text) pairs; None where none has data."""
    if not any(curves for _, curves in series):
        return None
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    several = max(len(curves) for _, curves in series) > 1
    for label, curves in series:
        for name, text in curves:
            ax.plot(*_series(text), marker="o", markersize=3, label=f"{label}: {name}" if several else label)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def save_figure(fig: Figure, path: Path) -> str:
    """Writes the figure as PNG (atomically); returns the file name."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    atomic_write_bytes(path, buffer.getvalue())
    return path.name


def build_figures(series: list[tuple[str, Revision]]) -> list[tuple[str, str, Figure, str]]:
    """(title, file stem, figure, caption) of each plot that has data at the distinct revisions ``series``."""
    details = [(label, revision.read_json(DETAILS)) for label, revision in series]
    backends = _ordered_union([[d["headline_backend"]] for _, d in details
                               if isinstance(d, dict) and isinstance(d.get("headline_backend"), str)])
    backend = backends[0] if backends else "vllm"
    # vLLM counts n-gram acceptance only over the steps where the prompt lookup proposed: say so under the plot
    ngram_note = ("The n-gram rates are vLLM's own, over the steps where its prompt lookup proposed (conditional "
                  "on a match); compare the two drafters by speed-up." if backend == "vllm" else "")
    built = [
        ("Acceptance rate per draft position", "acceptance", acceptance_figure(details, backend), ngram_note),
        ("tau per category", "tau_per_category", tau_category_figure(details, backend), ""),
        ("Training against validation loss", "loss",
         loss_figure([(label, revision.read(TRAIN_LOSS), revision.read(VAL_LOSS)) for label, revision in series]),
         ""),
    ]
    for name, (title, paths) in CURVES.items():
        curves = [(label, [(Path(p).stem, text) for p in paths if (text := revision.read(p))])
                  for label, revision in series]
        built.append((title, name, curve_figure(title, curves), ""))
    return [entry for entry in built if entry[2] is not None]


def distinct_revisions(revisions: list[Revision]) -> list[tuple[str, Revision]]:
    """One (label, revision) per identity: names of one commit (or the workspace twice) share a label ``a = b``."""
    groups: dict[str, list[Revision]] = {}
    for revision in revisions:
        names = groups.setdefault(revision.identity, [])
        if all(known.rev != revision.rev for known in names):
            names.append(revision)
    return [(" = ".join(r.rev for r in names), names[0]) for names in groups.values()]


def write_report(repo: Path, revisions: list[str], base: str, out_dir: Path, samples: int = DEFAULT_SAMPLES,
                 seed: int = DEFAULT_SEED) -> Path:
    """Writes ``out_dir/report.md`` and its PNG plots; returns the Markdown path.

    Args:
        repo: The repository.
        revisions: The head revisions; empty means the workspace.
        base: The revision they are compared against.
        out_dir: Where report.md and the PNG files go.
        samples: Bootstrap resamples of the paired comparison.
        seed: Seed of the resampling.

    Raises:
        EaglenestError: A revision does not exist, too few samples, or an input file is malformed.
    """
    if samples < MIN_SAMPLES:
        raise EaglenestError(f"bootstrap samples must be at least {MIN_SAMPLES} (got {samples})")
    heads = revisions or [WORKSPACE]
    base_revision = Revision(repo, base)
    head_revisions = [Revision(repo, rev) for rev in heads]
    everything = [base_revision, *head_revisions]
    by_name = {revision.rev: revision for revision in everything}
    files = metric_files(everything)
    values = {name: read_metrics(revision, files) for name, revision in by_name.items()}
    series = distinct_revisions(everything)

    lines = [f"# eaglenest report: {', '.join(heads)} against {base}", ""]
    for label, revision in series:
        if " = " in label:
            lines += [f"{label.replace(' = ', ' and ')} are the same revision ({revision.short}): "
                      "each plot draws it once.", ""]
    lines += ["## Headline metrics", "", *metrics_table(base, heads, values), ""]
    for head in head_revisions:
        lines += paired_section(base_revision, head, samples, seed)
    lines += ["## Plots", ""]
    plots = build_figures(series)
    for title, name, fig, caption in plots:
        lines += [f"### {title}", "", f"![{title}]({save_figure(fig, out_dir / f'{name}.png')})", ""]
        lines += [caption, ""] if caption else []
    if not plots:
        lines += ["(no plot data at these revisions)", ""]
    report = out_dir / "report.md"
    atomic_write_bytes(report, "\n".join(lines).encode())
    return report
