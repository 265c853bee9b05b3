"""Bootstrap 95% intervals over prompts, for figures that are ratios of sums (tau, speed-up).

tau over a set is ``1 + sum(accepted) / sum(steps)``, not a mean of per-prompt taus, so the interval resamples
whole prompts (or whole conversations, whose turns are not independent) and recomputes the ratio from the
resampled sums. A paired comparison of two revisions resamples the same prompts for both, which cancels the
prompt-to-prompt spread both share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# statistic(totals) -> figure; totals: [..., m] sums of the m per-prompt quantities, figure: [...]
Statistic = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Interval:
    """A figure and its bootstrap 95% interval.

    Attributes:
        value: The figure on the whole set.
        low: The 2.5th percentile of the resampled figures.
        high: The 97.5th percentile.
        units: How many independent units (prompts or conversations) were resampled.
    """

    value: float
    low: float
    high: float
    units: int

    @property
    def half_width(self) -> float:
        """Half the interval's width: the '±' a reader quotes."""
        return (self.high - self.low) / 2

    def excludes_zero(self) -> bool:
        """Whether the interval lies wholly above or wholly below 0 (a paired difference that is real)."""
        return self.low > 0 or self.high < 0

    def as_dict(self, places: int = 4) -> dict[str, float | int]:
        return {
            "value": round(self.value, places),
            "low": round(self.low, places),
            "high": round(self.high, places),
            "ci95": round(self.half_width, places),
            "units": self.units,
        }


def bootstrap(sums: np.ndarray, statistic: Statistic, samples: int, seed: int) -> Interval:
    """The statistic on ``sums.sum(0)`` and its percentile interval over ``samples`` resamples of the rows.

    Args:
        sums: ``[units, m]``: each unit's (prompt's or conversation's) sums of the m quantities.
        statistic: ``[..., m] -> [...]``: the figure from summed quantities.
        samples: Resamples.
        seed: Seed of the resampling, so the same records give the same interval.
    """
    units = sums.shape[0]
    value = float(statistic(sums.sum(0)))
    if units < 2:
        return Interval(value, value, value, units)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, units, size=(samples, units))  # [samples, units]
    resampled = statistic(sums[picks].sum(1))  # [samples]
    low, high = np.percentile(resampled, [2.5, 97.5])
    return Interval(value, float(low), float(high), units)


def tau_statistic(totals: np.ndarray) -> np.ndarray:
    """``[..., 2]`` (accepted, steps) -> tau = 1 + accepted / steps."""
    return 1 + totals[..., 0] / np.maximum(totals[..., 1], 1)


def speedup_statistic(totals: np.ndarray) -> np.ndarray:
    """``[..., 4]`` (spec tokens, spec seconds, plain tokens, plain seconds) -> spec tokens/s over plain tokens/s."""
    spec_rate = totals[..., 0] / np.maximum(totals[..., 1], 1e-12)
    plain_rate = totals[..., 2] / np.maximum(totals[..., 3], 1e-12)
    return spec_rate / np.maximum(plain_rate, 1e-12)


def difference(statistic: Statistic, width: int) -> Statistic:
    """For paired sums ``[..., 2 * width]`` (base quantities, then head's): head's statistic minus base's."""

    def paired(totals: np.ndarray) -> np.ndarray:
        return statistic(totals[..., width:]) - statistic(totals[..., :width])

    return paired
