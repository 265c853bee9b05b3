"""An endpoint's figures at one concurrency (tokens/s, latency, TTFT, acceptance), and where speculation stops paying.
"""

from __future__ import annotations

import math
from typing import Any

from eaglenest.commands.bench.counters import Acceptance


def _stats_ms(values: list[float]) -> dict[str, float] | None:
    """Mean, median and 99th percentile in milliseconds (numpy's percentiles, as vLLM's bench takes them)."""
    import numpy as np

    if not values:
        return None
    array = np.asarray(values, dtype=np.float64) * 1000
    return {"mean": round(float(array.mean()), 2), "p50": round(float(np.percentile(array, 50)), 2),
            "p99": round(float(np.percentile(array, 99)), 2)}


def endpoint_figures(raw: dict[str, Any], spec: Acceptance | None, problems: list[str],
                     raw_name: str) -> dict[str, Any]:
    """One endpoint's figures at one concurrency, from vLLM's result and the counters."""
    ok = [i for i, error in enumerate(raw.get("errors", [])) if not error and raw["latencies"][i] > 0]
    figures: dict[str, Any] = {
        "completed": int(raw["completed"]), "failed": int(raw["failed"]),
        "output_tokens": int(raw["total_output_tokens"]), "duration_s": round(float(raw["duration"]), 3),
        "tokens_per_s": round(float(raw["output_throughput"]), 3),
        "requests_per_s": round(float(raw["request_throughput"]), 4),
        "latency_ms": _stats_ms([raw["latencies"][i] for i in ok]),
        "ttft_ms": _stats_ms([raw["ttfts"][i] for i in ok]),
    }
    if spec is not None:
        figures |= spec.as_json() | {"tau_vllm": _rounded(raw.get("spec_decode_acceptance_length"))}
    errors = [str(error).strip() for error in raw.get("errors", []) if error and str(error).strip()]
    if errors:  # the last line of the first (often a traceback): what went wrong, in a line
        figures["first_error"] = errors[0].splitlines()[-1][:300]
    return figures | {"counter_problems": problems, "raw": raw_name}


def _rounded(value: Any) -> float | None:
    return round(float(value), 4) if isinstance(value, int | float) and math.isfinite(value) else None


def stops_paying_at(results: list[dict[str, Any]]) -> int | None:
    """The lowest concurrency measured whose speed-up is below 1; None when speculation pays at all of them."""
    below = [r["concurrency"] for r in results if r["speedup"] is not None and r["speedup"] < 1.0]
    return min(below) if below else None
