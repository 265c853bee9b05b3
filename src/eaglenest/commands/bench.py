"""``eaglenest bench``: the served draft against a baseline server under concurrent load.

::

    eaglenest bench --url http://127.0.0.1:8000 --baseline-url http://127.0.0.1:8001 \\
        --prompts data/eval/general.jsonl [--concurrency 1 4 16] [--num-prompts 64] [--max-tokens 64]

``--url`` is an OpenAI-compatible vLLM server with speculative decoding (``eaglenest serve``, or a ``vllm serve``
elsewhere); ``--baseline-url`` serves the same model without the draft (the verifier alone, or vLLM's n-gram
drafting). At each concurrency, each endpoint in turn gets the same requests.

The load and its timing are vLLM's own benchmark, ``vllm bench serve``, run once per concurrency and endpoint
(``--max-concurrency C``, every request sent at once, closed loop). It runs as
``python -c <BENCH_LAUNCHER>``: the CPU build's ``vllm`` console script asks importlib.metadata for a distribution
named ``vllm`` and fails before it parses its arguments, so the launcher builds ``vllm bench serve``'s parser
(``vllm.benchmarks.serve.add_cli_args``) and calls its ``main``, which is all the subcommand does.

How the same prompts reach both servers: the prompts file (JSONL of ``{"messages": [...]}``, ``{"prompt": "..."}``
or FastChat ``question.jsonl`` ``{"turns": [...]}``, read as evaluate reads its sets; the first turn of a
multi-turn record, as the later ones follow the verifier's own answers) is rendered with the verifier's chat
template to token ids, here, once. They go to vLLM's ``custom`` dataset as ``{"prompt": [ids]}`` records, with
``--skip-tokenizer-init`` (the client then never tokenizes nor templates, and the completions endpoint receives the
id list as it is), ``--disable-shuffle --no-oversample`` (request i is prompt i mod P, on both endpoints) and the
length as ``--extra-body '{"max_tokens": M}'`` (without a tokenizer the dataset would ask for one token). The
client counts output tokens from the server's ``usage``; vLLM leaves the TTFT percentiles out without a tokenizer,
so they are computed here from its per-request ``ttfts`` (``--save-detailed``).

Acceptance: the server's ``/metrics`` is read (``prometheus_client``'s parser) before and after each run: tau =
1 + accepted / drafts and the per-position acceptance (accepted at position i / drafts) over the run, vLLM's
definition, held equal to the figure ``vllm bench serve`` derives from the same counters. The run's counters are
also held to its responses (generated tokens and successful requests). A warm-up run per endpoint
(``--warmup-prompts``) precedes the sweep, so the measured runs carry neither a test request nor warm-up
requests, and both readings bracket exactly the requests measured.

Results go to ``--out``: ``bench.json`` (rewritten after every concurrency, atomically), ``speedup.png`` and
``raw/`` (vLLM's result files and logs). ``stops_paying_at`` is the lowest concurrency whose speed-up (draft
tokens/s over baseline tokens/s) is below 1. At temperature 0 the draft's outputs are compared with the baseline's
request by request (text equality; in bf16 a near-tie may legitimately flip a token, so a difference is reported,
not refused). Exit status: 0; 1 when a request failed; 2 on a refusal (one line): an unreachable server, one that
serves another model, a draft server without spec-decode counters, a prompts file in none of the formats, or a
server that stops answering mid-run (the concurrencies measured before stay in bench.json).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.core.atomic import atomic_write_bytes, atomic_write_json, remove_stale_temps
from eaglenest.core.errors import EaglenestError, InputFileError

DEFAULT_CONCURRENCY = [1, 4, 16]
DEFAULT_OUT = Path("bench/results/serve")
# `vllm bench serve` exactly as vLLM's CLI runs it (BenchmarkServingSubcommand.cmd is main(args)), without the
# CLI's top-level parser, which fails on the CPU build (see the module docstring).
BENCH_LAUNCHER = (
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "parser = FlexibleArgumentParser(prog='vllm bench serve'); add_cli_args(parser); main(parser.parse_args())"
)
HTTP_TIMEOUT_S = 10.0
# vLLM's counter families (vllm/v1/spec_decode/metrics.py, vllm/v1/metrics/loggers.py), as prometheus_client's
# parser names them: without the `_total` of their samples.
DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
GENERATION_TOKENS = "vllm:generation_tokens"
REQUEST_SUCCESS = "vllm:request_success"


@dataclass(frozen=True)
class Counters:
    """The counters of one ``/metrics`` reading, each summed over its label sets (engines).

    Attributes:
        totals: Counter family name -> value.
        accepted_per_pos: Draft position -> accepted tokens there.
    """

    totals: dict[str, float]
    accepted_per_pos: dict[int, float]

    @property
    def has_spec_decode(self) -> bool:
        return DRAFTS in self.totals and ACCEPTED in self.totals


def parse_metrics(text: str, where: str) -> Counters:
    """The counters of a Prometheus text exposition.

    Only the ``_total`` samples are summed: prometheus_client also exposes ``_created`` timestamps.

    Raises:
        EaglenestError: text the parser refuses (naming ``where``).
    """
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            if family.type != "counter":
                continue
            for sample in family.samples:
                if not sample.name.endswith("_total"):
                    continue
                totals[family.name] = totals.get(family.name, 0.0) + sample.value
                if family.name == ACCEPTED_PER_POS and "position" in sample.labels:
                    position = int(sample.labels["position"])
                    per_pos[position] = per_pos.get(position, 0.0) + sample.value
    except ValueError as err:
        raise EaglenestError(f"{where}: not Prometheus text ({err}); is it a vLLM server?") from None
    return Counters(totals, per_pos)


def acceptance(before: Counters, after: Counters) -> dict[str, Any] | None:
    """Speculative decoding over the requests between two readings; None without spec-decode counters.

    Returns:
        ``drafts``, ``draft_tokens``, ``accepted_tokens`` (the differences), ``tau`` = 1 + accepted / drafts and
        ``per_position_acceptance`` = accepted at position i / drafts (None without a draft), as vLLM defines them.
    """
    if not (before.has_spec_decode and after.has_spec_decode):
        return None
    drafts = after.totals[DRAFTS] - before.totals[DRAFTS]
    accepted = after.totals[ACCEPTED] - before.totals[ACCEPTED]
    draft_tokens = after.totals.get(DRAFT_TOKENS, 0.0) - before.totals.get(DRAFT_TOKENS, 0.0)
    positions = sorted(set(before.accepted_per_pos) | set(after.accepted_per_pos))
    per_pos = [int(after.accepted_per_pos.get(p, 0.0) - before.accepted_per_pos.get(p, 0.0)) for p in positions]
    return {"drafts": int(drafts), "draft_tokens": int(draft_tokens), "accepted_tokens": int(accepted),
            "accepted_per_position": per_pos, "tau": round(1 + accepted / drafts, 4) if drafts > 0 else None,
            "per_position_acceptance": [round(n / drafts, 4) for n in per_pos] if drafts > 0 else None}


def counter_problems(before: Counters, after: Counters, spec: dict[str, Any] | None, raw: dict[str, Any],
                     spec_expected: bool) -> list[str]:
    """Where a run's counters disagree with its responses or with vLLM's own reading of them; [] when none.

    Args:
        before: The reading before the run.
        after: The reading after it.
        spec: :func:`acceptance` of the two.
        raw: ``vllm bench serve``'s result of the run.
        spec_expected: The endpoint serves a draft (every decode step drafts).
    """
    problems = []
    if GENERATION_TOKENS in after.totals:
        generated = after.totals[GENERATION_TOKENS] - before.totals.get(GENERATION_TOKENS, 0.0)
        if int(generated) != int(raw.get("total_output_tokens", -1)):
            problems.append(f"{GENERATION_TOKENS} grew by {int(generated)}, the responses hold "
                            f"{raw.get('total_output_tokens')} tokens (other traffic on the server?)")
    if REQUEST_SUCCESS in after.totals:
        finished = after.totals[REQUEST_SUCCESS] - before.totals.get(REQUEST_SUCCESS, 0.0)
        if int(finished) != int(raw.get("completed", -1)):
            problems.append(f"{REQUEST_SUCCESS} grew by {int(finished)}, {raw.get('completed')} requests completed")
    if spec is None:
        return problems
    if spec_expected and spec["drafts"] == 0 and raw.get("total_output_tokens", 0) > raw.get("completed", 0):
        problems.append("no drafts during the run: is speculative decoding on?")
    if spec["accepted_tokens"] > spec["draft_tokens"]:
        problems.append(f"{spec['accepted_tokens']} tokens accepted of {spec['draft_tokens']} drafted")
    per_pos = spec["accepted_per_position"]
    if per_pos and sum(per_pos) != spec["accepted_tokens"]:
        problems.append(f"the accepted tokens per position sum to {sum(per_pos)}, not {spec['accepted_tokens']}")
    # a chain draft's token i is accepted only after token i-1 was
    if any(later > earlier for earlier, later in zip(per_pos, per_pos[1:], strict=False)):
        problems.append(f"accepted tokens per position rise with the position: {per_pos}")
    theirs = raw.get("spec_decode_acceptance_length")
    if spec["tau"] is not None and (theirs is None or abs(float(theirs) - spec["tau"]) > 1e-3):
        problems.append(f"tau {spec['tau']} from /metrics, vLLM's bench read {theirs}")
    return problems


class ServerGone(EaglenestError):
    """Nothing answers at a server's URL (``reason``: the connection's error)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Endpoint:
    """One server: its role in the comparison, the flag that named it, and its base URL (no ``/v1``)."""

    role: str
    flag: str
    url: str

    def get(self, path: str) -> str:
        """The body of GET ``path``.

        Raises:
            EaglenestError: nothing answers, or not with 200 (one line naming the flag and the URL).
        """
        try:
            with urllib.request.urlopen(self.url + path, timeout=HTTP_TIMEOUT_S) as response:
                return response.read().decode("utf-8", errors="replace")
        except urllib.error.HTTPError as err:
            raise EaglenestError(f"{self.flag} {self.url}: GET {path} answered {err.code} {err.reason}; is it a "
                                 "vLLM OpenAI-compatible server?") from None
        except (urllib.error.URLError, OSError) as err:
            reason = str(getattr(err, "reason", err))
            raise ServerGone(f"{self.flag} {self.url}: no server answers ({reason}); start it (eaglenest serve, "
                             "vllm serve) or fix the URL", reason) from None

    def models(self) -> dict[str, dict[str, Any]]:
        """The models ``/v1/models`` lists, by id."""
        body = self.get("/v1/models")
        try:
            listed = json.loads(body)["data"]
            return {str(m["id"]): m for m in listed}
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise EaglenestError(f"{self.flag} {self.url}: /v1/models is not an OpenAI model list "
                                 f"({type(err).__name__}); is it an OpenAI-compatible server?") from None

    def counters(self) -> Counters:
        return parse_metrics(self.get("/metrics"), f"{self.flag} {self.url}/metrics")


def base_url(url: str, flag: str) -> str:
    """The server's root URL: an OpenAI base URL's ``/v1`` and trailing slashes dropped."""
    parsed = urllib.parse.urlsplit(url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise EaglenestError(f"{flag} {url}: expected an http(s) URL such as http://127.0.0.1:8000")
    path = parsed.path.rstrip("/").removesuffix("/v1").rstrip("/")
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, path, "", ""))


def check_models(draft: Endpoint, baseline: Endpoint, model: str | None, expected: str | None) -> dict[str, Any]:
    """The model both endpoints serve, as the draft's ``/v1/models`` lists it.

    Args:
        draft: The speculative endpoint.
        baseline: The baseline endpoint.
        model: ``--model``; None: ``expected``, else the draft endpoint's only model.
        expected: The verifier record's name, when ``--tokenizer`` is the verifier stage's folder.
    """
    served = draft.models()
    wanted = model or expected
    why = "--model" if model else "the verifier's name in --tokenizer's verifier.json; --model overrides it"
    if wanted is None:
        if len(served) != 1:
            raise EaglenestError(f"--url {draft.url} serves {sorted(served) or 'no model'}; name the one to "
                                 "benchmark with --model")
        wanted = next(iter(served))
    if wanted not in served:
        raise EaglenestError(f"--url {draft.url} serves {sorted(served)}, not {wanted!r} ({why}); point --url at "
                             "a server of that model, or pass --model")
    other = baseline.models()
    if wanted not in other:
        raise EaglenestError(f"--baseline-url {baseline.url} serves {sorted(other)}, not {wanted!r} (what --url "
                             "serves): the two endpoints must serve the same model")
    return served[wanted]


def load_bench_tokenizer(directory: Path) -> tuple[Any, str | None]:
    """The tokenizer prompts are rendered with, and the served name its verifier record gives (else None).

    Args:
        directory: The verifier stage's folder (``verifier.json``), or any local tokenizer folder.
    """
    from eaglenest.artifacts.verifier import INFO_FILE, load_tokenizer, load_verifier_info

    if (directory / INFO_FILE).is_file():
        info, _ = load_verifier_info(directory)
        return load_tokenizer(directory), info.name
    if not directory.is_dir():
        raise EaglenestError(f"--tokenizer {directory}: not a folder; give the verifier stage's output "
                             "(models/verifier) or the served model's folder")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as err:
        raise EaglenestError(f"--tokenizer {directory}: no tokenizer there ({type(err).__name__}); give the "
                             "verifier stage's output (models/verifier) or the served model's folder") from None
    if not getattr(tokenizer, "chat_template", None):
        raise EaglenestError(f"--tokenizer {directory}: the tokenizer has no chat template; the prompts are "
                             "rendered with the verifier's own, so give an instruct/chat model's folder")
    return tokenizer, None


def render_prompts(conversations: list[Any], source: Path, tokenizer: Any) -> list[list[int]]:
    """Token ids of each conversation's first turn in the verifier's chat template, as evaluate renders it."""
    from eaglenest.core.params import EvalSetParams
    from eaglenest.stages.evaluate.sets import EvalSet

    eval_set = EvalSet(EvalSetParams(name="bench", source=str(source)), conversations, {})
    return [[int(t) for t in eval_set.render(c, 0, [], tokenizer)] for c in conversations]


@dataclass(frozen=True)
class BenchConfig:
    """What ``eaglenest bench`` was asked (its flags)."""

    url: str
    baseline_url: str
    prompts: Path
    model: str | None = None
    tokenizer: Path = Path("models/verifier")
    concurrency: tuple[int, ...] = tuple(DEFAULT_CONCURRENCY)
    num_prompts: int | None = None
    max_tokens: int = 64
    temperature: float = 0.0
    warmup_prompts: int = 2
    timeout_s: float = 600.0
    out: Path = DEFAULT_OUT


class RunStopped(Exception):
    """A ``vllm bench serve`` run or a reading around it could not finish: the message says why."""


def run_vllm_bench(endpoint: Endpoint, model: str, dataset: Path, num_requests: int, concurrency: int,
                   config: BenchConfig, raw_dir: Path, name: str) -> dict[str, Any]:
    """One ``vllm bench serve`` run; its result file's contents.

    Raises:
        RunStopped: it exited non-zero, ran past ``--timeout``, or left no result.
    """
    result_file = raw_dir / f"{name}.json"
    log_file = raw_dir / f"{name}.log"
    result_file.unlink(missing_ok=True)  # a stale file from an earlier run must not pass for this one's
    argv = [sys.executable, "-c", BENCH_LAUNCHER,
            "--backend", "openai", "--endpoint", "/v1/completions", "--base-url", endpoint.url, "--model", model,
            "--dataset-name", "custom", "--dataset-path", str(dataset), "--disable-shuffle", "--no-oversample",
            "--skip-tokenizer-init", "--num-prompts", str(num_requests), "--max-concurrency", str(concurrency),
            "--temperature", str(config.temperature), "--extra-body", json.dumps({"max_tokens": config.max_tokens}),
            "--percentile-metrics", "e2el", "--metric-percentiles", "50,99", "--disable-tqdm", "--seed", "0",
            "--save-result", "--save-detailed", "--result-dir", str(raw_dir), "--result-filename", result_file.name]
    try:
        with log_file.open("w") as log:
            done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=config.timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise RunStopped(f"ran past --timeout {config.timeout_s:g} s (log: {log_file})") from None
    if done.returncode != 0:
        raise RunStopped(f"vllm bench serve exited with {done.returncode}: "
                         f"{_failure_line(log_file.read_text(errors='replace'))} (log: {log_file})")
    try:
        return json.loads(result_file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise RunStopped(f"vllm bench serve left no result in {result_file} ({type(err).__name__}; log: "
                         f"{log_file})") from None


def _failure_line(log: str) -> str:
    """The line of a run's log that says why it failed: the exception's, else the last one.

    The exception's line is looked for because the interpreter's exit may print more after it (nanobind's leak
    report, from the triton that vLLM imports).
    """
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", line)]
    return (errors or lines or ["no output"])[-1][:300]


def _stats_ms(values: list[float]) -> dict[str, float] | None:
    """Mean, median and 99th percentile in milliseconds (numpy's percentiles, as vLLM's bench takes them)."""
    import numpy as np

    if not values:
        return None
    array = np.asarray(values, dtype=np.float64) * 1000
    return {"mean": round(float(array.mean()), 2), "p50": round(float(np.percentile(array, 50)), 2),
            "p99": round(float(np.percentile(array, 99)), 2)}


def endpoint_figures(raw: dict[str, Any], spec: dict[str, Any] | None, problems: list[str],
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
        figures |= {"tau": spec["tau"], "per_position_acceptance": spec["per_position_acceptance"],
                    "drafts": spec["drafts"], "draft_tokens": spec["draft_tokens"],
                    "accepted_tokens": spec["accepted_tokens"], "accepted_per_position": spec["accepted_per_position"],
                    "tau_vllm": _rounded(raw.get("spec_decode_acceptance_length"))}
    errors = [str(error).strip() for error in raw.get("errors", []) if error and str(error).strip()]
    if errors:  # the last line of the first (often a traceback): what went wrong, in a line
        figures["first_error"] = errors[0].splitlines()[-1][:300]
    return figures | {"counter_problems": problems, "raw": raw_name}


def _rounded(value: Any) -> float | None:
    return round(float(value), 4) if isinstance(value, int | float) and math.isfinite(value) else None


def compare_outputs(draft: dict[str, Any], baseline: dict[str, Any], prompt_ids: list[str]) -> dict[str, Any]:
    """The temperature-0 check: request by request (request i is prompt i mod P), are the texts identical?

    Requests that failed on either side are not compared.
    """
    compared, differ = 0, []
    for i, (ours, theirs) in enumerate(zip(draft["generated_texts"], baseline["generated_texts"], strict=True)):
        if draft["errors"][i] or baseline["errors"][i]:
            continue
        compared += 1
        if ours != theirs:
            differ.append({"request": i, "prompt": prompt_ids[i % len(prompt_ids)]})
    return {"compared": compared, "identical": compared - len(differ), "differ": differ}


def stops_paying_at(results: list[dict[str, Any]]) -> int | None:
    """The lowest concurrency measured whose speed-up is below 1; None when speculation pays at all of them."""
    below = [r["concurrency"] for r in results if r["speedup"] is not None and r["speedup"] < 1.0]
    return min(below) if below else None


def plot_speedup(results: list[dict[str, Any]], stops: int | None, path: Path) -> None:
    """Speed-up against concurrency with the break-even line, written as PNG (atomically)."""
    import io

    from matplotlib.figure import Figure

    points = [(r["concurrency"], r["speedup"]) for r in results if r["speedup"] is not None]
    # a Figure without pyplot: no global state, no display, and savefig renders with Agg
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    if points:
        ax.plot(*zip(*points, strict=True), marker="o", label="draft / baseline tokens/s")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="break-even")
    if stops is not None:
        ax.axvline(stops, color="tab:red", linestyle=":", linewidth=1, label=f"stops paying at {stops}")
    ax.set_xscale("log", base=2)
    ax.set_xticks([c for c, _ in points] or [1])
    ax.set_xticklabels([str(c) for c, _ in points] or ["1"])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("speed-up")
    ax.set_title("Speculative decoding speed-up against concurrency")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    atomic_write_bytes(path, buffer.getvalue())


def summary_lines(result: dict[str, Any]) -> list[str]:
    """The sweep as a short table, then what it found."""
    lines = [f"{'conc':>4}  {'draft tok/s':>11}  {'base tok/s':>10}  {'speed-up':>8}  {'tau':>5}  "
             f"{'p50 ms d/b':>15}  {'p99 ms d/b':>15}  {'identical':>9}  {'failed':>6}"]
    for r in result["results"]:
        d, b = r["draft"], r["baseline"]
        lat = {p: f"{_ms(d, p)}/{_ms(b, p)}" for p in ("p50", "p99")}
        same = "-" if r["outputs"] is None else f"{r['outputs']['identical']}/{r['outputs']['compared']}"
        speedup = "-" if r["speedup"] is None else f"{r['speedup']:.3f}x"
        tau = "-" if d.get("tau") is None else f"{d['tau']:.2f}"
        lines.append(f"{r['concurrency']:>4}  {d['tokens_per_s']:>11.1f}  {b['tokens_per_s']:>10.1f}  {speedup:>8}  "
                     f"{tau:>5}  {lat['p50']:>15}  {lat['p99']:>15}  {same:>9}  {d['failed'] + b['failed']:>6}")
    stops = result["stops_paying_at"]
    lines.append(f"speculation stops paying at concurrency {stops}" if stops is not None else
                 "speculation pays at every concurrency measured")
    for r in result["results"]:
        for role in ("draft", "baseline"):
            for problem in r[role]["counter_problems"]:
                lines.append(f"check: concurrency {r['concurrency']}, {role}: {problem}")
        if r["outputs"] is not None and r["outputs"]["differ"]:
            lines.append(f"check: concurrency {r['concurrency']}: {len(r['outputs']['differ'])} outputs differ "
                         "from the baseline's (bf16 near-ties can flip a token; see bench.json)")
    return lines


def _ms(figures: dict[str, Any], key: str) -> str:
    return "-" if figures["latency_ms"] is None else f"{figures['latency_ms'][key]:.0f}"


def _check_config(config: BenchConfig) -> None:
    """Refuses flag values that cannot make a sweep, before anything is read or started."""
    if not config.concurrency or min(config.concurrency) < 1:
        raise EaglenestError(f"--concurrency {' '.join(map(str, config.concurrency))}: every value must be at "
                             "least 1")
    for flag, value in (("--num-prompts", config.num_prompts), ("--max-tokens", config.max_tokens)):
        if value is not None and value < 1:
            raise EaglenestError(f"{flag} {value}: must be at least 1")
    if config.num_prompts is not None and config.num_prompts < max(config.concurrency):
        raise EaglenestError(f"--num-prompts {config.num_prompts}: below --concurrency {max(config.concurrency)}, "
                             "so that many requests are never in flight; raise --num-prompts (several times the "
                             "highest concurrency is best)")
    if config.warmup_prompts < 0:
        raise EaglenestError(f"--warmup-prompts {config.warmup_prompts}: must be 0 (no warm-up) or more")
    if config.temperature < 0:
        raise EaglenestError(f"--temperature {config.temperature}: must be 0 (greedy) or more")
    if config.timeout_s <= 0:
        raise EaglenestError(f"--timeout {config.timeout_s:g}: must be positive (seconds per run)")


def run_bench(config: BenchConfig) -> tuple[dict[str, Any], int]:
    """The sweep: checks, a warm-up per endpoint, then at each concurrency both endpoints in turn.

    Returns:
        The result written to ``--out``/bench.json, and the exit status (1 when a request failed).

    Raises:
        EaglenestError: a refusal, or a server that stopped answering (bench.json then keeps what was measured).
    """
    from eaglenest.core.vllm_support import installed_build
    from eaglenest.stages.evaluate.sets import read_jsonl_conversations

    _check_config(config)
    conversations = read_jsonl_conversations(config.prompts, "--prompts")
    if not conversations:
        raise InputFileError(f"--prompts: {config.prompts}: no prompts")
    build = installed_build()
    if build is None:
        raise EaglenestError(f"eaglenest bench runs vLLM's `vllm bench serve`, and this interpreter "
                             f"({sys.executable}) has no vLLM; install it (make setup) or run eaglenest from the "
                             "environment that has it")
    draft = Endpoint("draft", "--url", base_url(config.url, "--url"))
    baseline = Endpoint("baseline", "--baseline-url", base_url(config.baseline_url, "--baseline-url"))
    if draft.url == baseline.url:
        raise EaglenestError(f"--url and --baseline-url are both {draft.url}: the baseline is another server, the "
                             "same model without the draft (or with n-gram drafting)")
    for endpoint in (draft, baseline):
        endpoint.get("/v1/models")  # both reachable before the tokenizer loads
    tokenizer, expected = load_bench_tokenizer(config.tokenizer)
    served = check_models(draft, baseline, config.model, expected)
    model = str(served["id"])
    if not draft.counters().has_spec_decode:
        raise EaglenestError(f"--url {draft.url}: its /metrics has no vllm:spec_decode_* counters, so it serves "
                             f"{model} without speculative decoding; start it with the draft (eaglenest serve, or "
                             "vllm serve --speculative-config ...)")

    prompts = render_prompts(conversations, config.prompts, tokenizer)
    prompt_ids = [c.id for c in conversations]
    longest = max(len(p) for p in prompts) + config.max_tokens
    max_model_len = served.get("max_model_len")
    if isinstance(max_model_len, int) and longest > max_model_len:
        raise EaglenestError(f"--prompts {config.prompts}: the longest prompt plus --max-tokens is {longest} tokens, "
                             f"past the server's max_model_len {max_model_len}; lower --max-tokens or drop long "
                             "prompts")
    levels = sorted(set(config.concurrency))
    num_requests = config.num_prompts or 4 * levels[-1]

    out, raw_dir = config.out, config.out / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)
    (out / "speedup.png").unlink(missing_ok=True)  # an earlier run's plot must not pass for this one's
    dataset = raw_dir / "requests.jsonl"  # `custom` reads only a .jsonl name
    atomic_write_bytes(dataset, "".join(json.dumps({"prompt": prompts[i % len(prompts)]}) + "\n"
                                        for i in range(num_requests)).encode())
    result: dict[str, Any] = {
        "url": draft.url, "baseline_url": baseline.url, "model": model,
        "tool": f"vllm bench serve ({build.distribution} {build.version})",
        "prompts": {"file": str(config.prompts), "count": len(prompts), "requests": num_requests,
                    "tokens": [len(p) for p in prompts]},
        "max_tokens": config.max_tokens, "temperature": config.temperature, "concurrency": levels,
        "results": [], "stops_paying_at": None, "complete": False,
    }

    def stop(endpoint: Endpoint, concurrency: int | str, why: str) -> EaglenestError:
        measured = [r["concurrency"] for r in result["results"]]
        kept = f"bench.json keeps concurrency {measured}" if measured else "nothing was measured"
        message = (f"{endpoint.flag} {endpoint.url}: the run at concurrency {concurrency} did not finish: {why}; "
                   f"{kept} ({out / 'bench.json'})")
        result["stopped"] = message
        _write(result, out)
        return EaglenestError(message)

    if config.warmup_prompts:
        for endpoint in (draft, baseline):
            print(f"eaglenest bench: warming up {endpoint.role} ({endpoint.url})", flush=True)
            try:
                warm = run_vllm_bench(endpoint, model, dataset, min(config.warmup_prompts, num_requests), 1, config,
                                      raw_dir, f"warmup-{endpoint.role}")
            except RunStopped as err:
                raise stop(endpoint, "1 (warm-up)", str(err)) from None
            if not warm.get("completed"):  # a server that refuses every request: say why before the sweep
                why = endpoint_figures(warm, None, [], "").get("first_error", "no response")
                raise stop(endpoint, "1 (warm-up)", f"every request failed: {why}")

    failed = 0
    for concurrency in levels:
        measured: dict[str, Any] = {}
        raws: dict[str, dict[str, Any]] = {}
        for endpoint in (draft, baseline):
            name = f"{endpoint.role}-c{concurrency}"
            print(f"eaglenest bench: {endpoint.role} at concurrency {concurrency} ({num_requests} requests)",
                  flush=True)
            try:
                before = endpoint.counters()
                raw = run_vllm_bench(endpoint, model, dataset, num_requests, concurrency, config, raw_dir, name)
                after = endpoint.counters()
            except ServerGone as err:
                raise stop(endpoint, concurrency, f"the server stopped answering ({err.reason})") from None
            except (RunStopped, EaglenestError) as err:
                raise stop(endpoint, concurrency, str(err).removeprefix(f"{endpoint.flag} {endpoint.url}: ")) \
                    from None
            spec = acceptance(before, after)
            problems = counter_problems(before, after, spec, raw, spec_expected=endpoint is draft)
            measured[endpoint.role] = endpoint_figures(raw, spec, problems, f"raw/{name}.json")
            raws[endpoint.role] = raw
            failed += int(raw["failed"])
        base_rate = measured["baseline"]["tokens_per_s"]
        result["results"].append({
            "concurrency": concurrency,
            "speedup": round(measured["draft"]["tokens_per_s"] / base_rate, 4) if base_rate > 0 else None,
            "draft": measured["draft"], "baseline": measured["baseline"],
            "outputs": compare_outputs(raws["draft"], raws["baseline"], prompt_ids) if config.temperature == 0
            else None,
        })
        result["stops_paying_at"] = stops_paying_at(result["results"])
        _write(result, out)  # each concurrency is kept as soon as it is measured
    result["complete"] = True
    _write(result, out)
    return result, 1 if failed else 0


def _write(result: dict[str, Any], out: Path) -> None:
    """bench.json, and the plot of what it holds so far."""
    atomic_write_json(out / "bench.json", result)
    if result["results"]:
        plot_speedup(result["results"], result["stops_paying_at"], out / "speedup.png")


def bench(config: BenchConfig) -> int:
    """``eaglenest bench``: runs the sweep, prints its table; the exit status."""
    result, status = run_bench(config)
    print("\n".join(summary_lines(result)))
    print(f"wrote {config.out / 'bench.json'} and {config.out / 'speedup.png'}")
    if status:
        failed = sum(r[role]["failed"] for r in result["results"] for role in ("draft", "baseline"))
        print(f"eaglenest bench: {failed} requests failed (errors in {config.out / 'raw'})", file=sys.stderr)
    return status
