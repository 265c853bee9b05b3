"""The speed-up: the speculative engine's tokens/s over the plain engine's on the same prompts, decoded moments
apart, with its 95% interval, a bootstrap over prompts (:mod:`eaglenest.core.bootstrap`).

The figure is a ratio of sums (all tokens over all seconds of each engine), never a mean of per-prompt ratios, so
long answers weigh as they do in a server's tokens/s; the interval resamples whole units (prompts, or
conversations where turns share context) with both engines' figures of a unit together, which cancels the
prompt-to-prompt spread both share. evaluate (per conversation), the k_sweep stage (per turn) and ``eaglenest bench``
(per request, single stream) all report this one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from eaglenest.core.bootstrap import Interval, bootstrap, speedup_statistic


def paired_rows(spec: Sequence[Sequence[float]], plain: Sequence[Sequence[float]]) -> np.ndarray:
    """``[units, 4]``: spec tokens, spec seconds, plain tokens, plain seconds, from each engine's ``[tokens,
    seconds]`` per unit (unit i of both is the same prompt)."""
    if len(spec) != len(plain):
        raise ValueError(f"{len(spec)} speculative units against {len(plain)} plain ones: pairs need the same prompts")
    return np.array([[*s, *p] for s, p in zip(spec, plain, strict=True)], dtype=np.float64).reshape(-1, 4)


def speedup_interval(rows: np.ndarray, samples: int, seed: int) -> Interval:
    """The speed-up over ``rows`` (``[units, 4]``, :func:`paired_rows`) and its bootstrap 95% interval."""
    return bootstrap(rows, speedup_statistic, samples, seed)
