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
SIGKILL after ``STOP_GRACE_S``: :mod:`eaglenest.commands.supervised`), its output in ``raw/server-<role>.log``, and
is stopped whatever ends the bench: the last run, a refusal, Ctrl-C or SIGTERM; a bench killed with SIGKILL takes
its server's whole process tree with it. Flags after ``--`` go to both servers.

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
concurrency whose speed-up (draft tokens/s over baseline tokens/s) is below 1. At concurrency 1 a row also holds
``single_stream_speedup``: the same ratio over the requests' own seconds with its 95% interval over prompts, the
measurement kit's (:mod:`eaglenest.core.measure.speedup`), as evaluate and the k_sweep stage report it.
Exit status: 0; 1 when a request failed or an output at temperature 0 differs beyond a near-tie; 2 on a refusal
(one line): an unreachable server,
one that serves another model, a draft server without spec-decode counters, a prompts file in none of the
formats, a started server that exits or stays silent before it answers (naming its log), or a server that stops
answering mid-run (the concurrencies measured before stay in bench.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from eaglenest.commands.bench.config import BenchConfig, ServeSetup, check_config, default_tie_margin
from eaglenest.commands.bench.counters import acceptance, counter_problems
from eaglenest.commands.bench.endpoint import (
    Endpoint,
    ServerGone,
    base_url,
    check_models,
    draft_model,
    require_model,
    require_spec_decode,
)
from eaglenest.commands.bench.figures import endpoint_figures, single_stream_speedup, stops_paying_at
from eaglenest.commands.bench.load import RunStopped, run_vllm_bench
from eaglenest.commands.bench.outputs import Replay, ask_with_logprobs, compare_outputs, judge_difference
from eaglenest.commands.bench.prompts import bench_prompts_file, check_length, load_bench_tokenizer, render_prompts
from eaglenest.commands.bench.render import summary_lines, write_result
from eaglenest.commands.bench.servers import SERVER_HOST, StartedServer, server_command, sigterm_as_exit, started_server
from eaglenest.core.atomic import atomic_write_bytes, remove_stale_temps
from eaglenest.core.errors import EaglenestError, InputFileError

# A server that stopped answering mid-run may be dying: how long to wait for its exit status, for the message.
SERVER_EXIT_WAIT_S = 2.0


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
        write_result(self.result, self.config.out)

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
        single = single_stream_speedup(draft[1], baseline[1]) if concurrency == 1 else None
        return {
            "concurrency": concurrency,
            "speedup": round(draft[0]["tokens_per_s"] / base_rate, 4) if base_rate > 0 else None,
            "single_stream_speedup": single.as_dict() if single is not None else None,
            "draft": draft[0], "baseline": baseline[0],
            "outputs": self.check_outputs(concurrency, draft[1], baseline[1], baseline_endpoint)
            if self.config.temperature == 0 else None,
        }

    def check_outputs(self, concurrency: int, draft: dict[str, Any], baseline: dict[str, Any],
                      baseline_endpoint: Endpoint) -> dict[str, Any]:
        """The temperature-0 check: identical texts, else the near-tie rule against the baseline's replay."""
        compared = compare_outputs(draft, baseline, self.prompt_ids)
        near_ties, differ = [], []
        for entry in compared.differ:
            request = entry["request"]
            replay = self.replay(baseline_endpoint, request % len(self.prompts), concurrency)
            verdict = judge_difference(draft["generated_texts"][request], replay, self.tokenizer,
                                       self.result["tie_margin"])
            (near_ties if verdict.near_tie else differ).append(entry | verdict.detail)
        self.real_differences += len(differ)
        return {"compared": compared.compared, "identical": compared.identical, "near_ties": near_ties,
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
    from eaglenest.artifacts.eval_sets import read_jsonl_conversations

    check_config(config)
    prompts_file = bench_prompts_file(config.prompts)
    conversations = read_jsonl_conversations(prompts_file, "--prompts")
    if not conversations:
        raise InputFileError(f"--prompts: {config.prompts}: no prompts")
    build = _require_vllm()
    served: dict[str, Any] | None = None
    commands: dict[str, Any] = {}
    if config.serve is None:
        draft, baseline = _url_endpoints(config)
        urls = (draft.url, baseline.url)
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
        check_length(served, prompts, config)
    result = _new_result(config, f"vllm bench serve ({build.distribution} {build.version})", urls, served, prompts,
                         commands)
    sweep = Sweep(config, result, _write_requests(config, prompts, result["prompts"]["requests"]), prompts,
                  [c.id for c in conversations], tokenizer)
    if config.serve is None:
        _sweep_urls(sweep, draft, baseline, result["concurrency"])
    else:
        with sigterm_as_exit():
            _sweep_servers(sweep, config.serve, commands, result["concurrency"])
    result["complete"] = True
    sweep.write()
    return result, 1 if sweep.failed or sweep.real_differences else 0


def _require_vllm() -> Any:
    """The installed vLLM build (:class:`eaglenest.core.vllm_support.VllmBuild`), whose ``vllm bench serve`` makes
    the load; one line where this interpreter has none."""
    from eaglenest.core.vllm_support import installed_build

    build = installed_build()
    if build is None:
        raise EaglenestError(f"eaglenest bench runs vLLM's `vllm bench serve`, and this interpreter "
                             f"({sys.executable}) has no vLLM; install it (make setup) or run eaglenest from the "
                             "environment that has it")
    return build


def _url_endpoints(config: BenchConfig) -> tuple[Endpoint, Endpoint]:
    """The draft and baseline servers of ``--url`` and ``--baseline-url``, two servers that both answer."""
    draft = Endpoint("draft", "--url", base_url(str(config.url), "--url"))
    baseline = Endpoint("baseline", "--baseline-url", base_url(str(config.baseline_url), "--baseline-url"))
    if draft.url == baseline.url:
        raise EaglenestError(f"--url and --baseline-url are both {draft.url}: the baseline is another server, "
                             "the same model without the draft (or with n-gram drafting)")
    for endpoint in (draft, baseline):
        endpoint.get("/v1/models")  # both reachable before the tokenizer loads
    return draft, baseline


def _new_result(config: BenchConfig, tool: str, urls: tuple[str, str], served: dict[str, Any] | None,
                prompts: list[list[int]], commands: dict[str, Any]) -> dict[str, Any]:
    """bench.json before the first run: what is measured, how, and on which prompts."""
    levels = sorted(set(config.concurrency))
    result: dict[str, Any] = {
        "url": urls[0], "baseline_url": urls[1],
        "model": None if served is None else str(served["id"]),
        "tool": tool,
        "prompts": {"file": str(config.prompts), "count": len(prompts),
                    "requests": config.num_prompts or 4 * levels[-1], "tokens": [len(p) for p in prompts]},
        "max_tokens": config.max_tokens, "temperature": config.temperature, "concurrency": levels,
        "tie_margin": default_tie_margin() if config.tie_margin is None else config.tie_margin, "tie_checks": 0,
        "results": [], "stops_paying_at": None, "complete": False,
    }
    if config.serve is not None:
        result["servers"] = {
            role: {"kind": "draft" if role == "draft" else config.serve.baseline, "command": command.shell(),
                   "why": command.k_reason, "log": f"raw/server-{role}.log"}
            for role, command in commands.items()}
    return result


def _write_requests(config: BenchConfig, prompts: list[list[int]], num_requests: int) -> Path:
    """``--out`` cleared of an earlier run's leftovers, and the requests file ``vllm bench serve`` reads (request i
    is prompt i mod P)."""
    out, raw_dir = config.out, config.out / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)
    (out / "speedup.png").unlink(missing_ok=True)  # an earlier run's plot must not pass for this one's
    dataset = raw_dir / "requests.jsonl"  # `custom` reads only a .jsonl name
    atomic_write_bytes(dataset, "".join(json.dumps({"prompt": prompts[i % len(prompts)]}) + "\n"
                                        for i in range(num_requests)).encode())
    return dataset


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
        check_length(served, sweep.prompts, sweep.config)
        sweep.warm_up(draft)
        for concurrency in levels:
            draft_runs[concurrency] = sweep.measure(draft, concurrency)
            rows.append({"concurrency": concurrency, "speedup": None, "single_stream_speedup": None,
                         "draft": draft_runs[concurrency][0],
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
