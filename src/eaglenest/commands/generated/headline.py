"""The README's figures, rendered from the committed metrics: the headline, the table of what the demo measures,
``docs/img/headline.svg``, and docs/defaults.md's sentence on the committed draft's tau.

The headline states, from ``metrics/eval.json`` and ``metrics/eval/details.json``, the verdict per headline set (the
draft's single-stream speed over the n-gram baseline's at its measured setting, paired prompt by prompt, with its
95% interval: ahead, tie or behind); τ of the first headline set over the whole set and over its timed turns, its
single-stream speed-up and the n-gram baseline's with their intervals, lossless as evaluate checked it with the
fraction identical to plain decoding per set, the dtype and the host kind (the n-gram speed-up from the set's summary
in details.json); and, from the committed bench result
(:mod:`eaglenest.commands.generated.concurrency`), the served draft's speed-up single-stream and at each higher
concurrency.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglenest.artifacts.metrics_file import figure_text as figure
from eaglenest.artifacts.metrics_file import read_metrics, summary_figure_text, versus_text
from eaglenest.artifacts.serving_plan import PLAN_FILE
from eaglenest.commands.generated.concurrency import headline_clause, load_serve_record
from eaglenest.commands.generated.svg import BLUE, GREEN, ORANGE, label_bars, new_figure, page_style, svg_text
from eaglenest.core.errors import InputFileError
from eaglenest.core.host import HostKind

README_COMMAND = "eaglenest report --readme"
METRICS_SOURCE = "metrics/"
HEADLINE_SVG = "docs/img/headline.svg"
FREE_LABELS = {"ngram": "vLLM n-gram", "suffix": "vLLM suffix"}


def _headline_figures(repo: Path) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """The headline back end, ``metrics/eval.json`` and ``metrics/eval/details.json`` of ``repo``."""
    headline = read_metrics(repo / "metrics" / "eval.json")
    details = read_metrics(repo / "metrics" / "eval" / "details.json")
    backend = details.get("headline_backend")
    if backend not in ("hf", "vllm"):
        raise InputFileError(f"{repo / 'metrics/eval/details.json'}: no headline_backend; rerun evaluate")
    return backend, headline, details


def host_label(details: dict[str, Any]) -> str:
    """The host kind evaluate recorded, as people read it (:attr:`HostKind.label`)."""
    host = details.get("host")
    if not isinstance(host, dict):
        return "a host kind evaluate did not record"
    try:
        kind = HostKind(**{name: host[name] for name in HostKind.__dataclass_fields__ if name in host})
        return kind.label
    except TypeError:  # a record of another layout: its key still names the kind
        return str(host.get("key", "host kind not recorded"))


def _fraction(summary: dict[str, Any], key: str) -> str:
    value = summary.get(key)
    return f"{value:.3f}" if isinstance(value, int | float) else "—"


def _sets(headline: dict[str, Any], repo: Path) -> dict[str, dict[str, Any]]:
    sets = {name: figures for name, figures in headline.items() if isinstance(figures, dict)}
    if not sets:
        raise InputFileError(f"{repo / 'metrics/eval.json'}: holds no evaluation set")
    return sets


def _lossless(headline: dict[str, Any], runs: dict[str, Any], sets: list[str]) -> str:
    """Lossless as checked, and the fraction identical to plain decoding token for token per set."""
    lossless = headline.get("lossless")
    checked = "lossless on every turn as evaluate checks it" if lossless == 1 else f"lossless fraction {lossless}"
    identical = ", ".join(
        f"`{name}` {_fraction(runs.get(name, {}).get('summary', {}), 'identical_fraction')}" for name in sets
    )
    return f"{checked} (identical to plain decoding token for token: {identical})"


def _free_setting(runs: dict[str, Any]) -> str:
    """The fastest free drafter and its setting as evaluate ran them (the same on every set), in words."""
    for entry in runs.values():
        drafter = entry.get("free_drafter", "ngram")
        setting = entry.get(drafter)
        if drafter == "ngram" and isinstance(setting, dict) and isinstance(setting.get("window"), list):
            low, high = setting["window"]
            return f"n-gram drafting, window {low}:{high}, K = {setting.get('num_speculative_tokens')}"
        if drafter == "suffix" and isinstance(setting, dict) and "max_tree_depth" in setting:
            return (
                f"suffix decoding, tree depth {setting['max_tree_depth']}, spec factor {setting['max_spec_factor']:g}, "
                f"least probability {setting['min_token_prob']:g}, K = {setting.get('num_speculative_tokens')}"
            )
    return "its setting not recorded"


def _verdicts(headline: dict[str, Any], runs: dict[str, Any], backend: str, sets: list[str]) -> str:
    """Per set, ahead / tie / behind with the paired figure: ``ahead on `humaneval` (x1.052 ± 0.041)``."""
    said = []
    for name in sets:
        summary = runs.get(name, {}).get("summary", {})
        versus = summary.get("vs_free") or {}
        if "verdict" not in versus:
            continue
        word = {"ahead": "ahead on", "behind": "behind on", "tie": "a tie on"}[versus["verdict"]]
        said.append(f"{word} `{name}` ({figure(headline[name], f'{backend}_vs_free', 'x')})")
    return ", ".join(said) if said else "not measured (no timed turns)"


def _hybrid_verdicts(headline: dict[str, Any], runs: dict[str, Any], backend: str, sets: list[str]) -> str:
    """Per set, the hybrid over the fastest free drafter and over plain decoding, paired: ``ahead on `humaneval`
    (x1.052 ± 0.041; x1.9 ± 0.2 over plain)``; "" where evaluate measured no hybrid."""
    said = []
    for name in sets:
        summary = runs.get(name, {}).get("summary", {})
        versus = summary.get("hybrid_vs_free") or {}
        if "verdict" not in versus:
            continue
        word = {"ahead": "ahead on", "behind": "behind on", "tie": "a tie on"}[versus["verdict"]]
        said.append(
            f"{word} `{name}` ({figure(headline[name], f'{backend}_hybrid_vs_free', 'x')}; "
            f"{summary_figure_text(summary, 'hybrid_speedup', 'x')} over plain decoding)"
        )
    return ", ".join(said)


def headline_lines(repo: Path) -> list[str]:
    """The README's headline: the verdict per set, the first set's figures, lossless per set, host kind, the served
    draft under load."""
    backend, headline, details = _headline_figures(repo)
    sets = _sets(headline, repo)
    run = details.get("runs", {}).get(backend, {})
    runs = run.get("sets", {})
    first, figures = next(iter(sets.items()))
    timed = runs.get(first, {}).get("summary", {})
    timed_tau = figures.get(f"{backend}_tau_timed")
    on_timed = (
        f" ({timed_tau:.3f} on its {timed.get('timed_turns')} timed turns)"
        if isinstance(timed_tau, int | float)
        else ""
    )
    lossless = _lossless(headline, runs, list(sets))
    hybrid = _hybrid_verdicts(headline, runs, backend, list(sets))
    hybrid_said = (
        f"**The hybrid (the draft, and suffix decoding's continuation where it expects more tokens accepted) against "
        f"the fastest free drafter: {hybrid}** (single stream, paired prompt by prompt, 95% intervals; "
        f"{(run.get('hybrid') or {}).get('why', '')}). "
        if hybrid
        else ""
    )
    return [
        hybrid_said
        + f"**Against the fastest free drafter vLLM offers, at its fastest measured setting ({_free_setting(runs)}): "
        f"{_verdicts(headline, runs, backend, list(sets))}** (the draft's single-stream tokens/s over the free "
        f"drafter's, paired prompt by prompt, 95% intervals). `{first}`: τ {figure(figures, f'{backend}_tau')} "
        f"tokens per verifier step at K = {details.get('num_speculative_tokens')} over the set{on_timed}, and "
        f"{figure(figures, f'{backend}_speedup', 'x')} single-stream speed-up over plain decoding ({backend}; "
        f"n-gram drafting {summary_figure_text(timed, 'ngram_speedup', 'x')}, suffix decoding "
        f"{summary_figure_text(timed, 'suffix_speedup', 'x')}); {lossless}"
        f"; {run.get('dtype', '—')}, on {host_label(details)}. {headline_clause(load_serve_record(repo))}"
        f"{_plan_clause(repo)}"
    ]


def _plan_clause(repo: Path) -> str:
    """The serving plan's choice in one sentence (``metrics/serving_plan.json``); "" where there is none."""
    path = repo / PLAN_FILE
    if not path.is_file():
        return ""
    plan = read_metrics(path)
    return (
        f" **Served by `eaglenest serve` (the plan stage's choice): {plan.get('method')}**, because {plan.get('why')}."
    )


def demo_table(repo: Path) -> list[str]:
    """The README's table of what the demo measures, one row per headline set."""
    backend, headline, details = _headline_figures(repo)
    runs = details.get("runs", {}).get(backend, {}).get("sets", {})
    table = [
        f"| set | prompts | timed turns | {backend} τ (95%) | τ, timed turns | speed-up (95%) | "
        "n-gram speed-up (95%) | suffix speed-up (95%) | draft / fastest free (95%) | hybrid speed-up (95%) | "
        "hybrid / fastest free (95%) | lossless | identical to plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, values in _sets(headline, repo).items():
        summary = runs.get(name, {}).get("summary", {})
        timed_tau = values.get(f"{backend}_tau_timed")
        # lossless: every turn equal to plain decoding under the set's rule (exact, or a flipped near-tie below
        # float32); identical: the turns equal token for token
        table.append(
            f"| `{name}` | {summary.get('num_prompts', '—')} | {summary.get('timed_turns', '—')} | "
            f"{figure(values, f'{backend}_tau')} | "
            f"{f'{timed_tau:.3f}' if isinstance(timed_tau, int | float) else '—'} | "
            f"{figure(values, f'{backend}_speedup', 'x')} | "
            f"{summary_figure_text(summary, 'ngram_speedup', 'x')} | "
            f"{summary_figure_text(summary, 'suffix_speedup', 'x')} | "
            f"{versus_text(values, backend, summary)} | "
            f"{summary_figure_text(summary, 'hybrid_speedup', 'x')} | "
            f"{summary_figure_text(summary, 'hybrid_vs_free', 'x')} | "
            f"{_fraction(summary, 'lossless_fraction')} | {_fraction(summary, 'identical_fraction')} |"
        )
    return table


def readme_blocks(repo: Path) -> dict[str, list[str]]:
    """The README's generated blocks: the headline and the table of what the demo measures."""
    return {"headline": headline_lines(repo), "demo-table": demo_table(repo)}


def committed_tau_lines(repo: Path) -> list[str]:
    """docs/defaults.md's sentence: the committed draft's τ per headline set and on the validation split."""
    backend, headline, details = _headline_figures(repo)
    runs = details.get("runs", {}).get(backend, {}).get("sets", {})
    parts = [
        f"{headline[name][f'{backend}_tau']:.3f} on `{name}`"
        for name in _sets(headline, repo)
        if isinstance(headline[name].get(f"{backend}_tau"), int | float)
    ]
    val = runs.get("val", {}).get("summary", {}).get("tau", {})
    if isinstance(val, dict) and isinstance(val.get("value"), int | float):
        parts.append(f"{val['value']:.3f} on the validation split")
    listed = ", ".join(parts[:-1]) + f" and {parts[-1]}" if len(parts) > 1 else "".join(parts)
    return [
        f"The committed draft reaches {backend} τ {listed} at K = {details.get('num_speculative_tokens')} "
        f"(lossless {headline.get('lossless')}; `metrics/eval.json`),"
    ]


def _with_interval(figures: dict[str, Any], key: str, where: str) -> tuple[float, float]:
    """``figures[key]`` and its 95% half-width; one line naming the file and the key where either is missing."""
    value, half = figures.get(key), figures.get(f"{key}_ci95")
    if not isinstance(value, int | float) or not isinstance(half, int | float):
        raise InputFileError(
            f"{where}: no {key} with {key}_ci95; the figure {HEADLINE_SVG} needs both (rerun "
            "evaluate with vllm among its back ends)"
        )
    return float(value), float(half)


def _summary_interval(runs: dict[str, Any], name: str, key: str, where: str) -> tuple[float, float]:
    """A set's figure and its 95% half-width from its summary in details.json (:func:`_with_interval`'s rule)."""
    entry = runs.get(name, {}).get("summary", {}).get(key) or {}
    return _with_interval({key: entry.get("value"), f"{key}_ci95": entry.get("ci95")}, key, f"{where} ({name})")


def headline_svg(repo: Path) -> str:
    """The README's figure as SVG text: per headline set, τ (left) and the single-stream speed-up of the draft, of the
    fastest free drafter and, where evaluate measured it, of the hybrid (right), each with its 95% interval."""
    backend, headline, details = _headline_figures(repo)
    where = str(repo / "metrics" / "eval.json")
    sets = list(_sets(headline, repo))
    tau = [_with_interval(headline[name], f"{backend}_tau", where) for name in sets]
    draft = [_with_interval(headline[name], f"{backend}_speedup", where) for name in sets]
    runs = details.get("runs", {}).get(backend, {}).get("sets", {})
    details_path = str(repo / "metrics/eval/details.json")
    free = next((entry.get("free_drafter") for entry in runs.values() if entry.get("free_drafter")), "ngram")
    baseline = [_summary_interval(runs, name, f"{free}_speedup", details_path) for name in sets]
    series = [(draft, "the draft", BLUE), (baseline, FREE_LABELS.get(free, free), ORANGE)]
    if all("hybrid_speedup" in runs.get(name, {}).get("summary", {}) for name in sets):
        series.append(
            ([_summary_interval(runs, name, "hybrid_speedup", details_path) for name in sets], "hybrid", GREEN)
        )
    with page_style():
        fig = new_figure(8, 2.8)  # 576 x 202 pt: readable at a page's width
        left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2, 3]})
        positions = range(len(sets))
        left.bar(positions, [v for v, _ in tau], yerr=[h for _, h in tau], capsize=3, color=BLUE)
        left.set_ylim(1.0, max(v + h for v, h in tau) * 1.08)
        left.set_title(f"τ, tokens per verifier step (K = {details.get('num_speculative_tokens')})")
        width = 0.76 / len(series)
        for i, (values, label, colour) in enumerate(series):
            offset = (i - (len(series) - 1) / 2) * width
            right.bar(
                [p + offset for p in positions],
                [v for v, _ in values],
                width,
                yerr=[h for _, h in values],
                capsize=3,
                color=colour,
                label=label,
            )
        right.axhline(1.0, color="black", linewidth=0.8)
        speedups = [pair for values, _, _ in series for pair in values]
        right.set_ylim(min(0.8, min(v - h for v, h in speedups) - 0.05), max(v + h for v, h in speedups) + 0.1)
        right.set_title("single-stream speed-up over plain decoding")
        right.legend(loc="upper right", frameon=False)
        for axes in (left, right):
            axes.set_xticks(list(positions), sets)
            label_bars(axes)
        fig.suptitle(f"metrics/eval.json ({backend}; bars: 95% intervals over prompts)", fontsize=9)
        fig.tight_layout()
        return svg_text(fig)
