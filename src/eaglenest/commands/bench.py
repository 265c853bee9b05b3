"""``eaglenest bench``: the served draft against a baseline server under concurrent load.

::

    eaglenest bench --url http://127.0.0.1:8000 --baseline-url http://127.0.0.1:8001 \\
        --prompts data/eval/general.jsonl [--concurrency 1 4 16] [--num-prompts 64] [--max-tokens 64]
    eaglenest bench --serve [--baseline none|ngram] [--port 8000] [--verifier models/verifier] \\
        [--draft models/draft] --prompts data/eval/general.jsonl [...] [-- vLLM server flags]

``--url`` is an OpenAI-compatible vLLM server with speculative decoding (``eaglenest serve``, or a ``vllm serve``
elsewhere); ``--baseline-url`` serves the same model without the draft (the verifier alone, or vLLM's n-gram
drafting). At each concurrency, each endpoint in turn gets the same requests.

``--serve`` starts the two servers here instead, one after the other, so that on a machine of few cores neither
takes the other's: the draft server (``eaglenest serve``'s command, :func:`eaglenest.commands.serve.build_command`)
on 127.0.0.1:``--port``, waited for until ``/v1/models`` answers (``--server-timeout``), warmed up and measured at
every concurrency, then stopped; then the baseline server (``--baseline``: ``none``, the verifier alone, or
``ngram``) the same way on the same port. Each runs as a subprocess in its own process group (SIGTERM to the group,
SIGKILL after ``SERVER_STOP_GRACE_S``), its output in ``raw/server-<role>.log``, and is stopped whatever ends the
bench: the last run, a refusal, Ctrl-C or SIGTERM. Flags after ``--`` go to both servers.

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

Outputs at temperature 0, request by request: identical texts; else the evaluate stage's near-tie rule
(:mod:`eaglenest.core.lossless_rule`). ``vllm bench serve`` keeps only text, so for each prompt with a differing
output the baseline server is asked once more, that prompt alone, with its top ``TIE_CANDIDATES`` log-probs and
token ids (a check between runs, outside every measured window). The first token whose text the draft's output
leaves is the divergence; the draft's token there is the longest of the baseline's candidates its text continues
with. Within ``--tie-margin`` (default: ``evaluate.bf16_tie_margin``'s default) of the baseline's best, the
difference is a near-tie (counted, with the position, both tokens and the gap); otherwise, or where the draft's
text matches no candidate, a real difference.

Results go to ``--out``: ``bench.json`` (rewritten after every concurrency, atomically), ``speedup.png`` and
``raw/`` (vLLM's result files and logs, and the started servers' logs). ``stops_paying_at`` is the lowest
concurrency whose speed-up (draft tokens/s over baseline tokens/s) is below 1. Exit status: 0; 1 when a request
failed or an output at temperature 0 differs beyond a near-tie; 2 on a refusal (one line): an unreachable server,
one that serves another model, a draft server without spec-decode counters, a prompts file in none of the
formats, a started server that exits or stays silent before it answers (naming its log), or a server that stops
answering mid-run (the concurrencies measured before stay in bench.json).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.core.atomic import atomic_write_bytes, atomic_write_json, remove_stale_temps
from eaglenest.core.errors import EaglenestError, InputFileError
from eaglenest.core.lossless_rule import TIE_CANDIDATES, Divergence, TopCandidates, first_divergence, is_lossless

DEFAULT_CONCURRENCY = [1, 4, 16]
DEFAULT_OUT = Path("bench/results/serve")
DEFAULT_PORT = 8000
# Loading a verifier on a few CPU cores takes minutes; a server silent for this long is stuck.
DEFAULT_SERVER_TIMEOUT_S = 900.0
SERVER_HOST = "127.0.0.1"
# After SIGTERM, how long a started server (and its engine processes) may take to go before SIGKILL.
SERVER_STOP_GRACE_S = 30.0
SERVER_POLL_S = 0.5
# A server that stopped answering mid-run may be dying: how long to wait for its exit status, for the message.
SERVER_EXIT_WAIT_S = 2.0
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
    """One server: its role in the comparison, the flag that named it (or, started here, what it is), and its base
    URL (no ``/v1``)."""

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

    def post(self, path: str, body: dict[str, Any], timeout_s: float) -> Any:
        """The JSON answer to POST ``path`` with the JSON ``body``.

        Raises:
            ServerGone: nothing answers.
            EaglenestError: an answer other than 200 with JSON (its first 200 characters).
        """
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            detail = " ".join(err.read().decode("utf-8", errors="replace").split())[:200]
            raise EaglenestError(f"{self.flag} {self.url}: POST {path} answered {err.code} {err.reason}: "
                                 f"{detail}") from None
        except json.JSONDecodeError as err:
            raise EaglenestError(f"{self.flag} {self.url}: POST {path} answered with no JSON ({err})") from None
        except (urllib.error.URLError, OSError) as err:
            reason = str(getattr(err, "reason", err))
            raise ServerGone(f"{self.flag} {self.url}: no server answers ({reason})", reason) from None

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
    served = draft_model(draft, model, expected)
    require_model(baseline, str(served["id"]), draft)
    return served


def draft_model(draft: Endpoint, model: str | None, expected: str | None) -> dict[str, Any]:
    """The model to benchmark, as the draft endpoint's ``/v1/models`` lists it (see :func:`check_models`)."""
    served = draft.models()
    wanted = model or expected
    why = "--model" if model else "the verifier's name in --tokenizer's verifier.json; --model overrides it"
    if wanted is None:
        if len(served) != 1:
            raise EaglenestError(f"{draft.flag} {draft.url} serves {sorted(served) or 'no model'}; name the one to "
                                 "benchmark with --model")
        wanted = next(iter(served))
    if wanted not in served:
        raise EaglenestError(f"{draft.flag} {draft.url} serves {sorted(served)}, not {wanted!r} ({why}); point "
                             f"{draft.flag} at a server of that model, or pass --model")
    return served[wanted]


def require_model(baseline: Endpoint, model: str, draft: Endpoint) -> None:
    """Refuses a baseline endpoint that does not serve ``model``, the one the draft endpoint serves."""
    other = baseline.models()
    if model not in other:
        raise EaglenestError(f"{baseline.flag} {baseline.url} serves {sorted(other)}, not {model!r} (what "
                             f"{draft.flag} serves): the two endpoints must serve the same model")


def require_spec_decode(draft: Endpoint, model: str) -> None:
    """Refuses a draft endpoint whose ``/metrics`` has no speculative-decoding counters."""
    if not draft.counters().has_spec_decode:
        raise EaglenestError(f"{draft.flag} {draft.url}: its /metrics has no vllm:spec_decode_* counters, so it "
                             f"serves {model} without speculative decoding; start it with the draft (eaglenest "
                             "serve, or vllm serve --speculative-config ...)")


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


BUILTIN_PROMPTS = ("builtin:humaneval", "builtin:general", "builtin:long")


def bench_prompts_file(prompts: Path) -> Path:
    """The file ``--prompts`` names: a JSONL path, or one of evaluate's shipped sets by its ``source`` name."""
    from eaglenest.stages.evaluate.params import EvalSetParams
    from eaglenest.stages.evaluate.sets import source_file

    if str(prompts) in BUILTIN_PROMPTS:
        return source_file(EvalSetParams(name="bench", source=str(prompts)), Path("."))
    if str(prompts).startswith("builtin:"):
        raise EaglenestError(f"--prompts {prompts}: no such shipped set; choose {', '.join(BUILTIN_PROMPTS)} "
                             "or give a JSONL file")
    return prompts


def render_prompts(conversations: list[Any], source: Path, tokenizer: Any) -> list[list[int]]:
    """Token ids of each conversation's first turn in the verifier's chat template, as evaluate renders it."""
    from eaglenest.stages.evaluate.params import EvalSetParams
    from eaglenest.stages.evaluate.sets import EvalSet

    eval_set = EvalSet(EvalSetParams(name="bench", source=str(source)), conversations, {})
    return [[int(t) for t in eval_set.render(c, 0, [], tokenizer)] for c in conversations]


@dataclass(frozen=True)
class ServeSetup:
    """How ``--serve`` starts the servers (``eaglenest serve``'s flags, and vLLM's after ``--``)."""

    baseline: str = "none"
    port: int = DEFAULT_PORT
    verifier: Path = Path("models/verifier")
    draft: Path = Path("models/draft")
    dtype: str = "auto"
    num_speculative_tokens: int | None = None
    timeout_s: float = DEFAULT_SERVER_TIMEOUT_S
    vllm_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class BenchConfig:
    """What ``eaglenest bench`` was asked (its flags).

    Attributes:
        url: ``--url``, the draft server; None with ``serve``.
        baseline_url: ``--baseline-url``; None with ``serve``.
        tokenizer: ``--tokenizer``; None: ``serve.verifier``, else ``models/verifier``.
        tie_margin: ``--tie-margin``; None: ``evaluate.bf16_tie_margin``'s default.
        serve: ``--serve``: the servers to start here, one after the other; None: the two URLs.
    """

    url: str | None
    baseline_url: str | None
    prompts: Path
    model: str | None = None
    tokenizer: Path | None = None
    concurrency: tuple[int, ...] = tuple(DEFAULT_CONCURRENCY)
    num_prompts: int | None = None
    max_tokens: int = 64
    temperature: float = 0.0
    warmup_prompts: int = 2
    timeout_s: float = 600.0
    out: Path = DEFAULT_OUT
    tie_margin: float | None = None
    serve: ServeSetup | None = None

    @property
    def tokenizer_dir(self) -> Path:
        return self.tokenizer or (self.serve.verifier if self.serve is not None else Path("models/verifier"))


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


@dataclass(frozen=True)
class Replay:
    """The baseline's answer to one prompt asked alone at temperature 0.

    Attributes:
        tokens: Its output token ids.
        top: Its top candidates (token, log-prob) at each output position, best first.
        text: Its output text, as the server detokenized it.
    """

    tokens: list[int]
    top: list[TopCandidates]
    text: str


def ask_with_logprobs(endpoint: Endpoint, model: str, prompt: list[int], max_tokens: int,
                      timeout_s: float) -> Replay:
    """The baseline's output for ``prompt`` alone, with its top ``TIE_CANDIDATES`` log-probs at each token.

    The request is the measured one (token ids, ``max_tokens``, ``repetition_penalty`` 1 as ``vllm bench serve``
    sends it) at temperature 0, unstreamed, with vLLM's ``return_tokens_as_token_ids`` so candidates come as ids.

    Raises:
        ServerGone: nothing answers.
        EaglenestError: the server refused the request, or answered without token-id log-probs.
    """
    body = endpoint.post("/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "repetition_penalty": 1.0,
        "logprobs": TIE_CANDIDATES, "return_tokens_as_token_ids": True, "stream": False}, timeout_s)
    try:
        return parse_replay(body)
    except ValueError as err:
        raise EaglenestError(f"{endpoint.flag} {endpoint.url}: {err}") from None


def parse_replay(body: Any) -> Replay:
    """A completion answer with ``logprobs`` and ``return_tokens_as_token_ids`` as a :class:`Replay`.

    Raises:
        ValueError: an answer of another shape (one line).
    """
    try:
        choice = body["choices"][0]
        logprobs = choice["logprobs"]
        tokens = [_token_id(token) for token in logprobs["tokens"]]
        # vLLM lists the chosen token, then the top ones: ranked here by log-prob, as evaluate ranks them
        top = [sorted(((_token_id(key), float(value)) for key, value in (position or {}).items()),
                      key=lambda candidate: -candidate[1])[:TIE_CANDIDATES] for position in logprobs["top_logprobs"]]
        text = str(choice["text"])
    except (KeyError, IndexError, TypeError, ValueError) as err:
        raise ValueError(f"the completion has no token-id log-probs ({type(err).__name__}: {err}); is it a vLLM "
                         "server (logprobs with return_tokens_as_token_ids)?") from None
    if len(top) != len(tokens):
        raise ValueError(f"the completion has {len(tokens)} tokens but log-probs for {len(top)}")
    return Replay(tokens, top, text)


def _token_id(token: str) -> int:
    match = re.fullmatch(r"token_id:(\d+)", token)
    if match is None:
        raise ValueError(f"token {token!r} is not token_id:N")
    return int(match.group(1))


def _text(tokenizer: Any, ids: list[int]) -> str:
    """Output ids as the server's output text (special tokens skipped, no clean-up of spaces)."""
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _whole(text: str) -> str:
    """``text`` without a character cut in two at its end (decoded bytes of an incomplete character)."""
    return text.rstrip("\ufffd")


def draft_divergence(draft_text: str, plain: list[int], plain_top: list[TopCandidates], tokenizer: Any
                     ) -> Divergence | None:
    """Where the draft's output text first leaves the baseline's tokens, judged by :func:`first_divergence`.

    The divergence is the first baseline token whose text the draft's text does not continue with (or an end the
    draft did not share). The draft's token there is the longest of the baseline's candidates whose text the
    draft's continues with (an end token: where the draft's text ends there); none: the divergence has no gap.

    Args:
        draft_text: The draft server's output text.
        plain: The baseline's output token ids for the same prompt.
        plain_top: The baseline's top candidates at each of its output positions.
        tokenizer: The served model's tokenizer.

    Returns:
        None when the draft's text is the baseline's.
    """
    prefixes = [_text(tokenizer, plain[:i]) for i in range(len(plain) + 1)]
    for i, token in enumerate(plain):
        before, upto = prefixes[i], prefixes[i + 1]
        if upto == before:  # no text (a special token): the draft must end here too when the baseline does
            if i < len(plain) - 1 or draft_text == before:
                continue
        elif draft_text.startswith(_whole(upto)):
            continue
        matches = []
        for rank, (candidate, _) in enumerate(plain_top[i] if i < len(plain_top) else []):
            if candidate == token:
                continue
            text = _text(tokenizer, plain[:i] + [candidate])
            if text == before:
                if draft_text == before:
                    matches.append((0, -rank, candidate))
            elif len(_whole(text)) > len(_whole(before)) and draft_text.startswith(_whole(text)):
                matches.append((len(_whole(text)), -rank, candidate))
        spec = plain[:i] + ([max(matches)[2]] if matches else [])
        return first_divergence(plain, spec, plain_top)
    if draft_text == prefixes[-1]:
        return None
    return Divergence(len(plain), None, None, None, None)  # the draft's text goes on past the baseline's


def tokenization_alternatives(draft_text: str, plain: list[int], plain_top: list[TopCandidates], tokenizer: Any,
                              before: int) -> list[Divergence]:
    """Other divergences the draft's text allows up to position ``before`` (latest first): positions where the
    draft's text continues with the baseline's token and also with a longer candidate of the baseline's top ones,
    and at ``before`` every candidate the text continues with.

    The bench receives the draft's text, not its tokens: where the baseline emitted ``' '`` and then ``'1'``, a draft
    that emitted ``' delim'`` there reads as having taken ``' '`` and parted one position later, at a token the
    baseline never considered. Each alternative is the divergence as if the draft had taken that longer candidate.
    """
    found = []
    for i in range(min(before + 1, len(plain))):
        # before the divergence the draft's text continues with the baseline's token, and only a longer candidate
        # is another reading; at it, any candidate the text continues with is one (not only the longest)
        shared = _whole(_text(tokenizer, plain[: i + 1] if i < before else plain[:i]))
        if i < before and not draft_text.startswith(shared):
            break
        for candidate, _ in plain_top[i] if i < len(plain_top) else []:
            text = _whole(_text(tokenizer, plain[:i] + [candidate]))
            if candidate != plain[i] and len(text) > len(shared) and draft_text.startswith(text):
                divergence = first_divergence(plain, plain[:i] + [candidate], plain_top)
                if divergence is not None:
                    found.append(divergence)
    return found[::-1]


def judge_difference(draft_text: str, replay: Replay | str, tokenizer: Any, margin: float) -> dict[str, Any]:
    """One differing output under the near-tie rule: ``near_tie`` and where, which tokens, the gap, or why not.

    Args:
        draft_text: The draft server's output text.
        replay: The baseline's replay of the prompt, or why there is none.
        tokenizer: The served model's tokenizer.
        margin: ``--tie-margin``.
    """
    if isinstance(replay, str):
        return {"near_tie": False, "why": replay}
    if _text(tokenizer, replay.tokens) != replay.text:
        return {"near_tie": False, "why": "the tokenizer decodes the baseline's tokens to another text than the "
                "server's, so the draft's text cannot be placed on them"}
    divergence = draft_divergence(draft_text, replay.tokens, replay.top, tokenizer)
    if divergence is None:
        return {"near_tie": True, "position": None, "why": "the baseline asked alone gives the draft's text: its "
                "own output varies between runs"}
    ambiguous = False
    if not is_lossless(divergence, margin):
        # the text may hide where the draft's tokens parted: take an earlier reading that is a near-tie, if any
        for alternative in tokenization_alternatives(draft_text, replay.tokens, replay.top, tokenizer,
                                                     divergence.position):
            if is_lossless(alternative, margin):
                divergence, ambiguous = alternative, True
                break
    at = len(_whole(_text(tokenizer, replay.tokens[:divergence.position])))
    entry: dict[str, Any] = {
        "position": divergence.position, "baseline_token": divergence.plain_token,
        "baseline_text": None if divergence.plain_token is None else tokenizer.decode([divergence.plain_token]),
        "draft_token": divergence.spec_token,
        "draft_text": (tokenizer.decode([divergence.spec_token]) if divergence.spec_token is not None
                       else draft_text[at:at + 16]),
        "gap": divergence.gap, "rank": divergence.spec_rank,
    }
    if ambiguous:
        entry["read_from_text"] = ("only the draft's text comes back, and it reads as this token here as well as "
                                   "the way that parts beyond a near-tie: read as this one")
    near = is_lossless(divergence, margin)
    if not near:
        if divergence.plain_token is None:
            entry["why"] = "the draft's output goes on where the baseline's ends"
        elif divergence.gap is None:
            entry["why"] = f"the draft's text there begins with none of the baseline's top {TIE_CANDIDATES} tokens"
        else:
            entry["why"] = f"the gap {divergence.gap:g} is above the margin {margin:g}"
    return {"near_tie": near, **entry}


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


def server_command(serve: ServeSetup, model: str | None, baseline: str | None, cpu_build: bool) -> Any:
    """``eaglenest serve``'s command for the draft server (``baseline`` None) or a baseline one, on ``--port``.

    Returns:
        A :class:`eaglenest.commands.serve.ServeCommand`.
    """
    from eaglenest.commands.serve import OWN_FLAGS, build_command

    for arg in serve.vllm_args:
        flag = arg.split("=", 1)[0]
        if flag in OWN_FLAGS:
            instead = ("--model" if flag == "--served-model-name" else
                       "nothing: the servers listen on 127.0.0.1" if flag == "--host" else OWN_FLAGS[flag])
            raise EaglenestError(f"{flag} after --: eaglenest bench --serve sets it; use {instead} (before --)")
    return build_command(serve.verifier, serve.draft, SERVER_HOST, serve.port, serve.dtype, cpu_build=cpu_build,
                         num_speculative_tokens=serve.num_speculative_tokens, served_model_name=model,
                         vllm_args=list(serve.vllm_args), baseline=baseline)


class StartedServer:
    """A server bench started: a subprocess in its own process group, its output in a log file.

    Its own group: Ctrl-C at the terminal does not reach it (bench stops it, in order), and a signal to the group
    reaches vLLM's engine processes too.
    """

    def __init__(self, role: str, command: Any, url: str, log: Path) -> None:
        self.role, self.command, self.url, self.log = role, command, url, log
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as log:  # the child keeps its own descriptor
            try:
                self.process = subprocess.Popen(self.command.argv, stdin=subprocess.DEVNULL, stdout=log,
                                                stderr=subprocess.STDOUT, env={**os.environ, **self.command.env},
                                                start_new_session=True)
            except OSError as err:
                raise EaglenestError(f"the {self.role} server did not start: {err}") from None

    def exit_status(self, wait_s: float = 0.0) -> int | None:
        """The server's exit status; None while it runs (after waiting up to ``wait_s`` for it to end)."""
        if self.process is None:
            return None
        try:
            return self.process.wait(timeout=wait_s) if wait_s > 0 else self.process.poll()
        except subprocess.TimeoutExpired:
            return None

    def wait_until_ready(self, timeout_s: float) -> float:
        """Seconds until ``/v1/models`` answered.

        Raises:
            EaglenestError: the server exited first, or stayed silent ``timeout_s`` (one line naming its log).
        """
        start = time.monotonic()
        while True:
            status = self.exit_status()
            if status is not None:
                why = _failure_line(self.log.read_text(errors="replace"))
                raise EaglenestError(f"the {self.role} server exited with {status} before it answered at "
                                     f"{self.url}/v1/models: {why} (log: {self.log})")
            if _answers(self.url + "/v1/models"):
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise EaglenestError(f"the {self.role} server did not answer at {self.url}/v1/models within "
                                     f"--server-timeout {timeout_s:g} s (log: {self.log}); raise --server-timeout "
                                     "if it was still loading")
            time.sleep(SERVER_POLL_S)

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``SERVER_STOP_GRACE_S``; returns once it is gone."""
        if self.process is None:
            return
        group = self.process.pid  # start_new_session: the group's id is the leader's pid
        _signal_group(group, signal.SIGTERM)
        try:
            self.process.wait(timeout=SERVER_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            _signal_group(group, signal.SIGKILL)
            self.process.wait()
        # The leader gone, its engine processes may still be shutting down: the next server needs the cores.
        deadline = time.monotonic() + SERVER_STOP_GRACE_S
        while _signal_group(group, 0):
            if time.monotonic() > deadline:
                _signal_group(group, signal.SIGKILL)
                break
            time.sleep(0.1)


def _signal_group(group: int, signum: int) -> bool:
    """Sends ``signum`` to a process group; False when the group has no process left."""
    try:
        os.killpg(group, signum)
    except ProcessLookupError:
        return False
    except PermissionError:  # a group id reused by another user's processes: not ours
        return False
    return True


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


@contextlib.contextmanager
def started_server(role: str, command: Any, serve: ServeSetup, log: Path) -> Iterator[StartedServer]:
    """The server, started and answering; stopped on leaving, whatever the way out."""
    from eaglenest.commands.serve import check_port_free

    check_port_free(SERVER_HOST, serve.port)
    server = StartedServer(role, command, f"http://{SERVER_HOST}:{serve.port}", log)
    print(f"eaglenest bench: starting the {role} server ({command.k_reason}; log: {log})", flush=True)
    try:
        server.start()
        waited = server.wait_until_ready(serve.timeout_s)
        print(f"eaglenest bench: the {role} server answers at {server.url} (after {waited:.0f} s)", flush=True)
        yield server
    finally:
        if server.process is not None:
            server.stop()
            print(f"eaglenest bench: stopped the {role} server", flush=True)


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit while bench holds started servers, so that they are stopped on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def summary_lines(result: dict[str, Any]) -> list[str]:
    """The sweep as a short table, then what it found."""
    lines = [f"{'conc':>4}  {'draft tok/s':>11}  {'base tok/s':>10}  {'speed-up':>8}  {'tau':>5}  "
             f"{'p50 ms d/b':>15}  {'p99 ms d/b':>15}  {'identical':>9}  {'ties':>4}  {'differ':>6}  {'failed':>6}"]
    for r in result["results"]:
        d, b, outputs = r["draft"], r["baseline"], r["outputs"]
        lat = {p: f"{_ms(d, p)}/{_ms(b, p)}" for p in ("p50", "p99")}
        same, ties, differ = ("-", "-", "-") if outputs is None else (
            f"{outputs['identical']}/{outputs['compared']}", str(len(outputs["near_ties"])),
            str(len(outputs["differ"])))
        speedup = "-" if r["speedup"] is None else f"{r['speedup']:.3f}x"
        tau = "-" if d.get("tau") is None else f"{d['tau']:.2f}"
        lines.append(f"{r['concurrency']:>4}  {d['tokens_per_s']:>11.1f}  {b['tokens_per_s']:>10.1f}  {speedup:>8}  "
                     f"{tau:>5}  {lat['p50']:>15}  {lat['p99']:>15}  {same:>9}  {ties:>4}  {differ:>6}  "
                     f"{d['failed'] + b['failed']:>6}")
    stops = result["stops_paying_at"]
    lines.append(f"speculation stops paying at concurrency {stops}" if stops is not None else
                 "speculation pays at every concurrency measured")
    for r in result["results"]:
        for role in ("draft", "baseline"):
            for problem in r[role]["counter_problems"]:
                lines.append(f"check: concurrency {r['concurrency']}, {role}: {problem}")
        outputs = r["outputs"]
        if outputs is not None and outputs["near_ties"]:
            lines.append(f"check: concurrency {r['concurrency']}: {len(outputs['near_ties'])} outputs leave the "
                         f"baseline's at a near-tie within --tie-margin {result['tie_margin']:g}: "
                         f"{_few(outputs['near_ties'], _tie_text)}")
        if outputs is not None and outputs["differ"]:
            lines.append(f"check: concurrency {r['concurrency']}: {len(outputs['differ'])} outputs differ from the "
                         f"baseline's beyond a near-tie: {_few(outputs['differ'], _difference_text)}")
    return lines


def _few(entries: list[dict[str, Any]], text: Callable[[dict[str, Any]], str], shown: int = 3) -> str:
    more = f"; {len(entries) - shown} more in bench.json" if len(entries) > shown else ""
    return "; ".join(text(e) for e in entries[:shown]) + more


def _tie_text(entry: dict[str, Any]) -> str:
    where = f"request {entry['request']} (prompt {entry['prompt']})"
    if entry["position"] is None:
        return f"{where}: {entry['why']}"
    return (f"{where} at token {entry['position']}: baseline {entry['baseline_text']!r}, draft "
            f"{entry['draft_text']!r}, gap {entry['gap']:g}")


def _difference_text(entry: dict[str, Any]) -> str:
    at = f" at token {entry['position']}" if entry.get("position") is not None else ""
    return f"request {entry['request']} (prompt {entry['prompt']}){at}: {entry['why']}"


def _ms(figures: dict[str, Any], key: str) -> str:
    return "-" if figures["latency_ms"] is None else f"{figures['latency_ms'][key]:.0f}"


def _check_config(config: BenchConfig) -> None:
    """Refuses flag values that cannot make a sweep, before anything is read or started."""
    urls = [flag for flag, value in (("--url", config.url), ("--baseline-url", config.baseline_url)) if value]
    if config.serve is not None and urls:
        raise EaglenestError(f"--serve with {' and '.join(urls)}: --serve starts both servers here, one after the "
                             f"other; drop {' and '.join(urls)}, or drop --serve to benchmark servers already running")
    if config.serve is None and len(urls) < 2:
        missing = " and ".join(f for f in ("--url", "--baseline-url") if f not in urls)
        raise EaglenestError(f"{missing} missing: give the draft server's --url and the baseline's --baseline-url, "
                             "or --serve to start both here, one after the other")
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
    if config.tie_margin is not None and config.tie_margin < 0:
        raise EaglenestError(f"--tie-margin {config.tie_margin:g}: must be 0 (identical outputs only) or more")
    if config.serve is not None:
        if config.serve.baseline not in ("none", "ngram"):
            raise EaglenestError(f"--baseline {config.serve.baseline}: expected none or ngram")
        if not 0 < config.serve.port < 65536:
            raise EaglenestError(f"--port {config.serve.port}: expected a port, 1 to 65535")
        if config.serve.timeout_s <= 0:
            raise EaglenestError(f"--server-timeout {config.serve.timeout_s:g}: must be positive (seconds a server "
                                 "may take to answer)")


def default_tie_margin() -> float:
    """``evaluate.bf16_tie_margin``'s default: ``--tie-margin`` when not given."""
    from eaglenest.stages.evaluate.params import EvaluateParams

    return float(EvaluateParams.model_fields["bf16_tie_margin"].default)


class Sweep:
    """One bench's measurements: its requests, bench.json as measured so far, and the temperature-0 checks.

    Args:
        config: The flags.
        result: bench.json's contents, filled as the sweep goes.
        dataset: The requests file ``vllm bench serve`` reads.
        prompts: Token ids of each prompt; request i is prompt i mod P.
        prompt_ids: Each prompt's id in the prompts file.
        tokenizer: The served model's, for the near-tie check.
    """

    def __init__(self, config: BenchConfig, result: dict[str, Any], dataset: Path, prompts: list[list[int]],
                 prompt_ids: list[str], tokenizer: Any) -> None:
        self.config, self.result, self.dataset = config, result, dataset
        self.prompts, self.prompt_ids, self.tokenizer = prompts, prompt_ids, tokenizer
        self.raw_dir = config.out / "raw"
        self.failed = 0
        self.real_differences = 0
        self.replays: dict[int, Replay | str] = {}  # by prompt: one check per prompt, whatever the concurrency
        self.servers: dict[str, StartedServer] = {}  # by role, with --serve

    @property
    def model(self) -> str:
        return str(self.result["model"])

    def write(self) -> None:
        self.result["stops_paying_at"] = stops_paying_at(self.result["results"])
        _write(self.result, self.config.out)

    def stop(self, endpoint: Endpoint, concurrency: int | str, why: str) -> EaglenestError:
        """The one-line error of a run that could not finish, bench.json written with what was measured."""
        rows = self.result["results"]
        measured = [r["concurrency"] for r in rows if r["baseline"] is not None]
        drafted = [r["concurrency"] for r in rows if r["baseline"] is None]  # --serve: the baseline's not yet run
        kept = f"bench.json keeps concurrency {measured}" if measured else "nothing was measured"
        if drafted:
            kept = (f"{kept} and the draft's figures at {drafted}" if measured else
                    f"bench.json keeps the draft's figures at concurrency {drafted}")
        where = str(self.config.out / "bench.json")
        if endpoint.role in self.servers:
            where += f"; server log: {self.servers[endpoint.role].log}"
        message = (f"{endpoint.flag} {endpoint.url}: the run at concurrency {concurrency} did not finish: {why}; "
                   f"{kept} ({where})")
        self.result["stopped"] = message
        self.write()
        return EaglenestError(message)

    def _gone(self, endpoint: Endpoint, reason: str) -> str:
        """Why an endpoint stopped answering: the connection's error, and a started server's exit status."""
        server = self.servers.get(endpoint.role)
        status = None if server is None else server.exit_status(wait_s=SERVER_EXIT_WAIT_S)
        return f"the server stopped answering ({reason})" + (f"; it exited with {status}" if status is not None
                                                             else "")

    def warm_up(self, endpoint: Endpoint) -> None:
        """An unmeasured run of ``--warmup-prompts`` requests; refuses an endpoint that fails every one."""
        if not self.config.warmup_prompts:
            return
        print(f"eaglenest bench: warming up {endpoint.role} ({endpoint.url})", flush=True)
        requests = min(self.config.warmup_prompts, self.result["prompts"]["requests"])
        try:
            warm = run_vllm_bench(endpoint, self.model, self.dataset, requests, 1, self.config, self.raw_dir,
                                  f"warmup-{endpoint.role}")
        except RunStopped as err:
            raise self.stop(endpoint, "1 (warm-up)", str(err)) from None
        if not warm.get("completed"):  # a server that refuses every request: say why before the sweep
            why = endpoint_figures(warm, None, [], "").get("first_error", "no response")
            raise self.stop(endpoint, "1 (warm-up)", f"every request failed: {why}")

    def measure(self, endpoint: Endpoint, concurrency: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """One endpoint's run at one concurrency: its figures, and vLLM's result."""
        name = f"{endpoint.role}-c{concurrency}"
        requests = self.result["prompts"]["requests"]
        print(f"eaglenest bench: {endpoint.role} at concurrency {concurrency} ({requests} requests)", flush=True)
        try:
            before = endpoint.counters()
            raw = run_vllm_bench(endpoint, self.model, self.dataset, requests, concurrency, self.config, self.raw_dir,
                                 name)
            after = endpoint.counters()
        except ServerGone as err:
            raise self.stop(endpoint, concurrency, self._gone(endpoint, err.reason)) from None
        except (RunStopped, EaglenestError) as err:
            raise self.stop(endpoint, concurrency, str(err).removeprefix(f"{endpoint.flag} {endpoint.url}: ")) \
                from None
        spec = acceptance(before, after)
        problems = counter_problems(before, after, spec, raw, spec_expected=endpoint.role == "draft")
        self.failed += int(raw["failed"])
        return endpoint_figures(raw, spec, problems, f"raw/{name}.json"), raw

    def row(self, concurrency: int, draft: tuple[dict[str, Any], dict[str, Any]],
            baseline: tuple[dict[str, Any], dict[str, Any]], baseline_endpoint: Endpoint) -> dict[str, Any]:
        """One concurrency's line of bench.json from both endpoints' (figures, vLLM result); the baseline endpoint
        still answering, for the near-tie checks."""
        base_rate = baseline[0]["tokens_per_s"]
        return {
            "concurrency": concurrency,
            "speedup": round(draft[0]["tokens_per_s"] / base_rate, 4) if base_rate > 0 else None,
            "draft": draft[0], "baseline": baseline[0],
            "outputs": self.check_outputs(concurrency, draft[1], baseline[1], baseline_endpoint)
            if self.config.temperature == 0 else None,
        }

    def check_outputs(self, concurrency: int, draft: dict[str, Any], baseline: dict[str, Any],
                      baseline_endpoint: Endpoint) -> dict[str, Any]:
        """The temperature-0 check: identical texts, else the near-tie rule against the baseline's replay."""
        compared = compare_outputs(draft, baseline, self.prompt_ids)
        near_ties, differ = [], []
        for entry in compared["differ"]:
            request = entry["request"]
            replay = self.replay(baseline_endpoint, request % len(self.prompts), concurrency)
            verdict = judge_difference(draft["generated_texts"][request], replay, self.tokenizer,
                                       self.result["tie_margin"])
            (near_ties if verdict.pop("near_tie") else differ).append(entry | verdict)
        self.real_differences += len(differ)
        return {"compared": compared["compared"], "identical": compared["identical"], "near_ties": near_ties,
                "differ": differ}

    def replay(self, endpoint: Endpoint, prompt: int, concurrency: int) -> Replay | str:
        """The baseline's replay of one prompt (asked once per bench), or why there is none."""
        if prompt not in self.replays:
            self.result["tie_checks"] += 1
            try:
                self.replays[prompt] = ask_with_logprobs(endpoint, self.model, self.prompts[prompt],
                                                         self.config.max_tokens, self.config.timeout_s)
            except ServerGone as err:
                raise self.stop(endpoint, concurrency, f"{self._gone(endpoint, err.reason)} during the near-tie "
                                "check") from None
            except EaglenestError as err:
                why = str(err).removeprefix(f"{endpoint.flag} {endpoint.url}: ")
                self.replays[prompt] = f"the baseline's near-tie check failed: {why}"
        return self.replays[prompt]


def _check_length(served: dict[str, Any], prompts: list[list[int]], config: BenchConfig) -> None:
    """Refuses prompts that do not fit the server's context with ``--max-tokens``."""
    longest = max(len(p) for p in prompts) + config.max_tokens
    max_model_len = served.get("max_model_len")
    if isinstance(max_model_len, int) and longest > max_model_len:
        raise EaglenestError(f"--prompts {config.prompts}: the longest prompt plus --max-tokens is {longest} tokens, "
                             f"past the server's max_model_len {max_model_len}; lower --max-tokens or drop long "
                             "prompts")


def run_bench(config: BenchConfig) -> tuple[dict[str, Any], int]:
    """The sweep: checks, then each endpoint warmed up and measured at each concurrency, the outputs compared.

    With two URLs, both endpoints take turns at each concurrency; with ``--serve``, the draft server does the whole
    sweep, is stopped, then the baseline server does it.

    Returns:
        The result written to ``--out``/bench.json, and the exit status (1 when a request failed, or an output at
        temperature 0 differs from the baseline's beyond a near-tie).

    Raises:
        EaglenestError: a refusal, or a server that stopped answering (bench.json then keeps what was measured).
    """
    from eaglenest.core.vllm_support import installed_build
    from eaglenest.stages.evaluate.sets import read_jsonl_conversations

    _check_config(config)
    prompts_file = bench_prompts_file(config.prompts)
    conversations = read_jsonl_conversations(prompts_file, "--prompts")
    if not conversations:
        raise InputFileError(f"--prompts: {config.prompts}: no prompts")
    build = installed_build()
    if build is None:
        raise EaglenestError(f"eaglenest bench runs vLLM's `vllm bench serve`, and this interpreter "
                             f"({sys.executable}) has no vLLM; install it (make setup) or run eaglenest from the "
                             "environment that has it")
    served: dict[str, Any] | None = None
    if config.serve is None:
        draft = Endpoint("draft", "--url", base_url(str(config.url), "--url"))
        baseline = Endpoint("baseline", "--baseline-url", base_url(str(config.baseline_url), "--baseline-url"))
        urls = (draft.url, baseline.url)
        if draft.url == baseline.url:
            raise EaglenestError(f"--url and --baseline-url are both {draft.url}: the baseline is another server, "
                                 "the same model without the draft (or with n-gram drafting)")
        for endpoint in (draft, baseline):
            endpoint.get("/v1/models")  # both reachable before the tokenizer loads
        commands = {}
    else:
        # both commands built (and their refusals made) before anything starts
        commands = {role: server_command(config.serve, config.model, kind, cpu_build=build.kind == "cpu")
                    for role, kind in (("draft", None), ("baseline", config.serve.baseline))}
        urls = (f"http://{SERVER_HOST}:{config.serve.port}",) * 2  # one port, one server at a time
    tokenizer, expected = load_bench_tokenizer(config.tokenizer_dir)
    if config.serve is None:
        served = check_models(draft, baseline, config.model, expected)
        require_spec_decode(draft, str(served["id"]))

    prompts = render_prompts(conversations, prompts_file, tokenizer)
    if served is not None:
        _check_length(served, prompts, config)
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
        "url": urls[0], "baseline_url": urls[1],
        "model": None if served is None else str(served["id"]),
        "tool": f"vllm bench serve ({build.distribution} {build.version})",
        "prompts": {"file": str(config.prompts), "count": len(prompts), "requests": num_requests,
                    "tokens": [len(p) for p in prompts]},
        "max_tokens": config.max_tokens, "temperature": config.temperature, "concurrency": levels,
        "tie_margin": default_tie_margin() if config.tie_margin is None else config.tie_margin, "tie_checks": 0,
        "results": [], "stops_paying_at": None, "complete": False,
    }
    if config.serve is not None:
        result["servers"] = {
            role: {"kind": "draft" if role == "draft" else config.serve.baseline, "command": command.shell(),
                   "why": command.k_reason, "log": f"raw/server-{role}.log"}
            for role, command in commands.items()}
    sweep = Sweep(config, result, dataset, prompts, [c.id for c in conversations], tokenizer)
    if config.serve is None:
        _sweep_urls(sweep, draft, baseline, levels)
    else:
        with _sigterm_as_exit():
            _sweep_servers(sweep, config.serve, commands, levels)
    result["complete"] = True
    sweep.write()
    return result, 1 if sweep.failed or sweep.real_differences else 0


def _sweep_urls(sweep: Sweep, draft: Endpoint, baseline: Endpoint, levels: list[int]) -> None:
    """Both servers up: each warmed up, then at each concurrency the draft's run and the baseline's in turn."""
    for endpoint in (draft, baseline):
        sweep.warm_up(endpoint)
    for concurrency in levels:
        measured = sweep.measure(draft, concurrency)
        sweep.result["results"].append(sweep.row(concurrency, measured, sweep.measure(baseline, concurrency),
                                                 baseline))
        sweep.write()  # each concurrency is kept as soon as it is measured


def _sweep_servers(sweep: Sweep, serve: ServeSetup, commands: dict[str, Any], levels: list[int]) -> None:
    """``--serve``: the draft server started, checked, swept and stopped, then the baseline server the same way."""
    out = sweep.config.out
    rows = sweep.result["results"]
    draft_runs: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
    with started_server("draft", commands["draft"], serve, out / "raw" / "server-draft.log") as server:
        sweep.servers["draft"] = server
        draft = Endpoint("draft", "the draft server", server.url)
        # the server answers to the name its command gave (--model, else the verifier's) and to the verifier's
        # path: the name is asked for, not guessed
        served = draft_model(draft, sweep.config.model, commands["draft"].served_name)
        sweep.result["model"] = str(served["id"])
        require_spec_decode(draft, sweep.model)
        _check_length(served, sweep.prompts, sweep.config)
        sweep.warm_up(draft)
        for concurrency in levels:
            draft_runs[concurrency] = sweep.measure(draft, concurrency)
            rows.append({"concurrency": concurrency, "speedup": None, "draft": draft_runs[concurrency][0],
                         "baseline": None, "outputs": None})
            sweep.write()  # the draft's figures are kept even if the baseline never runs
    with started_server("baseline", commands["baseline"], serve, out / "raw" / "server-baseline.log") as server:
        sweep.servers["baseline"] = server
        baseline = Endpoint("baseline", "the baseline server", server.url)
        require_model(baseline, sweep.model, draft)
        sweep.warm_up(baseline)
        for index, concurrency in enumerate(levels):
            rows[index] = sweep.row(concurrency, draft_runs[concurrency], sweep.measure(baseline, concurrency),
                                    baseline)
            sweep.write()


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
    failed = sum(r[role]["failed"] for r in result["results"] for role in ("draft", "baseline"))
    if failed:
        print(f"eaglenest bench: {failed} requests failed (errors in {config.out / 'raw'})", file=sys.stderr)
    differ = sum(len(r["outputs"]["differ"]) for r in result["results"] if r["outputs"] is not None)
    if differ:
        print(f"eaglenest bench: {differ} outputs at temperature 0 differ from the baseline's beyond a near-tie "
              f"within --tie-margin {result['tie_margin']:g} (see {config.out / 'bench.json'})", file=sys.stderr)
    return status
