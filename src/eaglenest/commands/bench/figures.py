"""An endpoint's figures at one concurrency (tokens/s, latency, TTFT, acceptance), pooled over rounds, the speed-up
with its interval over rounds, and where speculation stops paying.
"""

from __future__ import annotations

import math
from typing import Any

from eaglenest.commands.bench.counters import acceptance_json
from eaglenest.core.bootstrap import Interval
from eaglenest.core.measure.spec_counters import SpecCounts

# Student's t, 97.5th percentile, by degrees of freedom (1 to 30; past 30 the value at 30, a little wide): numpy
# has no quantile function, and the interval over rounds needs one at a handful of rounds.
T_975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)


def _stats_ms(values: list[float]) -> dict[str, float] | None:
    """Mean, median and 99th percentile in milliseconds (numpy's percentiles, as vLLM's bench takes them)."""
    import numpy as np

    if not values:
        return None
    array = np.asarray(values, dtype=np.float64) * 1000
    return {
        "mean": round(float(array.mean()), 2),
        "p50": round(float(np.percentile(array, 50)), 2),
        "p99": round(float(np.percentile(array, 99)), 2),
    }


def endpoint_figures(
    raw: dict[str, Any], spec: SpecCounts | None, problems: list[str], raw_name: str
) -> dict[str, Any]:
    """One endpoint's figures at one concurrency, from vLLM's result and the counters."""
    ok = [i for i, error in enumerate(raw.get("errors", [])) if not error and raw["latencies"][i] > 0]
    figures: dict[str, Any] = {
        "completed": int(raw["completed"]),
        "failed": int(raw["failed"]),
        "output_tokens": int(raw["total_output_tokens"]),
        "duration_s": round(float(raw["duration"]), 3),
        "tokens_per_s": round(float(raw["output_throughput"]), 3),
        "requests_per_s": round(float(raw["request_throughput"]), 4),
        "latency_ms": _stats_ms([raw["latencies"][i] for i in ok]),
        "ttft_ms": _stats_ms([raw["ttfts"][i] for i in ok]),
    }
    if spec is not None:
        figures |= acceptance_json(spec) | {"tau_vllm": _rounded(raw.get("spec_decode_acceptance_length"))}
    errors = [str(error).strip() for error in raw.get("errors", []) if error and str(error).strip()]
    if errors:  # the last line of the first (often a traceback): what went wrong, in a line
        figures["first_error"] = errors[0].splitlines()[-1][:300]
    return figures | {"counter_problems": problems, "raw": raw_name}


def _rounded(value: Any) -> float | None:
    return round(float(value), 4) if isinstance(value, int | float) and math.isfinite(value) else None


def request_turns(raw: dict[str, Any]) -> list[list[float] | None]:
    """``[output tokens, seconds]`` of each request of a ``vllm bench serve`` result (``--save-detailed``), None for
    one that failed."""
    lengths, latencies, errors = raw.get("output_lens") or [], raw.get("latencies") or [], raw.get("errors") or []
    return [
        None if (i < len(errors) and errors[i]) or latency <= 0 else [float(tokens), float(latency)]
        for i, (tokens, latency) in enumerate(zip(lengths, latencies, strict=False))
    ]


def single_stream_speedup(draft_raw: dict[str, Any], baseline_raw: dict[str, Any]) -> Interval | None:
    """At concurrency 1, the draft's tokens/s over the baseline's with its 95% interval, as evaluate and the k_sweep
    stage report theirs (:func:`eaglenest.core.measure.speedup.speedup_interval`, ``evaluate.bootstrap_samples``'
    and ``evaluate.seed``'s defaults): one request at a time, each request's tokens over its latency is a
    single-stream turn, and request i is prompt i mod P on both endpoints, so requests pair. None where no request
    succeeded on both, or the results hold no per-request figures."""
    from eaglenest.artifacts.eval_params import EvaluateParams
    from eaglenest.core.measure.speedup import paired_rows, speedup_interval

    pairs = [
        (d, b)
        for d, b in zip(request_turns(draft_raw), request_turns(baseline_raw), strict=False)
        if d is not None and b is not None
    ]
    if not pairs:
        return None
    defaults = EvaluateParams.model_fields
    return speedup_interval(
        paired_rows([d for d, _ in pairs], [b for _, b in pairs]),
        int(defaults["bootstrap_samples"].default),
        int(defaults["seed"].default),
    )


def pooled_raw(raws: list[dict[str, Any]]) -> dict[str, Any]:
    """Several ``vllm bench serve`` results of one endpoint at one concurrency as one: counts, tokens and seconds
    summed (so tokens/s is all tokens over all seconds), the per-request lists joined. vLLM's own tau is left out:
    it read each run's counters, and the pooled tau comes from the summed counters."""
    if len(raws) == 1:
        return raws[0]
    pooled: dict[str, Any] = {
        key: sum(raw[key] for raw in raws) for key in ("completed", "failed", "total_output_tokens", "duration")
    }
    for key in ("latencies", "ttfts", "errors", "output_lens", "generated_texts"):
        pooled[key] = [value for raw in raws for value in raw.get(key) or []]
    pooled["output_throughput"] = pooled["total_output_tokens"] / max(pooled["duration"], 1e-9)
    pooled["request_throughput"] = pooled["completed"] / max(pooled["duration"], 1e-9)
    return pooled


def rounds_interval(pairs: list[tuple[float, float]]) -> Interval | None:
    """The speed-up over rounds and its 95% interval: each round pairs the draft's tokens/s with the baseline's,
    measured one after the other at one concurrency; the figure is the geometric mean of the rounds' ratios, the
    interval Student's t over their logarithms (rounds - 1 degrees of freedom). None with fewer than two rounds.

    The round, not the request, is the unit: at concurrency C the requests of a run share every step, and a slow
    spell of the machine slows a whole run; a percentile bootstrap over so few units would claim more than they hold.
    """
    import numpy as np

    if len(pairs) < 2 or any(d <= 0 or b <= 0 for d, b in pairs):
        return None
    logs = np.log([d / b for d, b in pairs])
    mean, spread = float(logs.mean()), float(logs.std(ddof=1))
    half = T_975[min(len(pairs) - 1, len(T_975)) - 1] * spread / math.sqrt(len(pairs))
    return Interval(math.exp(mean), math.exp(mean - half), math.exp(mean + half), len(pairs))


def stops_paying_at(results: list[dict[str, Any]]) -> int | None:
    """The lowest concurrency measured whose speed-up is below 1; None when speculation pays at all of them."""
    below = [r["concurrency"] for r in results if r["speedup"] is not None and r["speedup"] < 1.0]
    return min(below) if below else None
