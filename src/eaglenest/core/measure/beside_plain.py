"""Speculative engines timed beside the plain one: the turns of each headline set decoded alone by every engine, the
engines taking turns prompt by prompt (:func:`~eaglenest.core.measure.single_stream.time_interleaved`), and each
engine's speed-up over the plain engine timed moments apart, with its 95% interval. The k_sweep stage (the draft at
each K) and the free_sweep stage (n-gram drafting at each K) time their candidates so.

A timed entry is ``{"turns": [[tokens, seconds], ...], "plain_turns": [[tokens, seconds], ...], ...}``: turn i
of both is the same prompt, decoded moments apart, so turns are resampled in pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from eaglenest.core.measure import engines as kit_engines
from eaglenest.core.measure import single_stream
from eaglenest.core.measure.spec_counters import SpecCounts, request_counts
from eaglenest.core.measure.speedup import paired_rows, speedup_interval


class SetSampling(Protocol):
    """How a set's turns are decoded: what a measurement reads of an entry of ``evaluate.sets`` (an
    :class:`eaglenest.artifacts.eval_params.EvalSetParams` is one)."""

    @property
    def max_new_tokens(self) -> int: ...

    @property
    def temperature(self) -> float: ...


class TimedSet(Protocol):
    """A set whose turns are timed: its name and its params (sampling, ``max_new_tokens``); an
    :class:`eaglenest.artifacts.eval_sets.EvalSet` is one."""

    @property
    def name(self) -> str: ...

    @property
    def params(self) -> SetSampling: ...


class Resampling(Protocol):
    """The seed of the sampled sets and of the bootstrap, and its resamples: what a measurement reads of
    ``evaluate:`` (an :class:`eaglenest.artifacts.eval_params.EvalSetsAndEngines` is one)."""

    @property
    def seed(self) -> int: ...

    @property
    def bootstrap_samples(self) -> int: ...


@dataclass(frozen=True)
class TimedTurns:
    """The headline sets and the prompts timed on them.

    Attributes:
        sets: The headline sets timed.
        prompts: Set name -> the prompts timed on it (token ids).
        warm_up: A prompt no engine is timed on.
        requests: The most tokens each engine's requests reach (timed and warm-up prompts with their answers and
            the largest K's drafts).
    """

    sets: list[TimedSet]
    prompts: dict[str, list[list[int]]]
    warm_up: list[int]
    requests: list[int]

    @property
    def every_prompt(self) -> list[list[int]]:
        """The timed prompts of every set, in order."""
        return [prompt for prompts in self.prompts.values() for prompt in prompts]


def time_beside_plain(
    turns: TimedTurns, plain: Any, engines: dict[str, Any], evaluate: Resampling, param: str, label: str
) -> dict[str, dict[str, Any]]:
    """Every set's timed turns on the plain engine and ``engines`` (name -> speculative engine), taking turns prompt
    by prompt; per engine and set its figures beside the plain engine's (:func:`timed_entry`), with the speed-up
    and its 95% interval. ``param`` is the params section named in vLLM's errors."""
    result: dict[str, dict[str, Any]] = {name: {} for name in engines}
    for eval_set in turns.sets:
        sampling = kit_engines.sampling_params(
            eval_set.params.max_new_tokens, eval_set.params.temperature, evaluate.seed
        )
        timed = single_stream.time_interleaved(
            {"plain": plain, **engines},
            turns.prompts[eval_set.name],
            sampling,
            param,
            f"{label}, {eval_set.name}, {', '.join(engines)}",
        )
        plain_turns = single_stream.tokens_and_seconds(timed["plain"])
        for name in engines:
            entry = timed_entry(timed[name], plain_turns)
            add_speedup(entry, evaluate.bootstrap_samples, evaluate.seed)
            result[name][eval_set.name] = entry
    return result


def timed_entry(timed: list[single_stream.Timed], plain_turns: list[list[float]]) -> dict[str, Any]:
    """One set's figures for one speculative engine: its turns beside the plain engine's, tokens/s of both, and tau
    over the verify steps that had a draft (every step, for a draft; n-gram drafts only on a match)."""
    turns = single_stream.tokens_and_seconds(timed)
    entry: dict[str, Any] = {
        "tokens_per_s": _rate(turns),
        "plain_tokens_per_s": _rate(plain_turns),
        "turns": turns,
        "plain_turns": plain_turns,
    }
    counts = [request_counts(output) for output, _ in timed]
    if counts and not any(c is None for c in counts):
        summed = sum((c for c in counts if c is not None), SpecCounts())
        entry |= {"steps_with_draft": summed.drafts, "tau_when_drafted": round(summed.tau or 1.0, 3)}
    return entry


def _rate(turns: list[list[float]]) -> float:
    return round(sum(t for t, _ in turns) / max(sum(s for _, s in turns), 1e-9), 2)


def pooled_speedup(entries: list[dict[str, Any]], samples: int, seed: int) -> tuple[float, float]:
    """The speed-up over all turns of ``entries`` pooled (tokens/s over the plain engine's) and half its 95%
    interval's width."""
    rows = paired_rows([t for e in entries for t in e["turns"]], [t for e in entries for t in e["plain_turns"]])
    interval = speedup_interval(rows, samples, seed)
    return round(interval.value, 3), round(interval.half_width, 3)


def add_speedup(entry: dict[str, Any], samples: int, seed: int) -> None:
    """One set's speed-up, with its 95% interval over its turns, into ``entry``."""
    entry["speedup"], entry["speedup_ci95"] = pooled_speedup([entry], samples, seed)
