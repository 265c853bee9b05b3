"""``eaglenest bench``: the served draft against a baseline server under concurrent load.

::

    eaglenest bench --url http://127.0.0.1:8000 --baseline-url http://127.0.0.1:8001 \\
        --prompts data/eval/general.jsonl [--concurrency 1 4 16] [--num-prompts 64] [--max-tokens 64]
    eaglenest bench --serve [--baseline none|ngram] [--port 8000] [--verifier models/verifier] \\
        [--draft models/draft] --prompts data/eval/general.jsonl [...] [-- vLLM server flags]

``--url`` is an OpenAI-compatible vLLM server with speculative decoding (``eaglenest serve``, or a ``vllm serve``
elsewhere); ``--baseline-url`` serves the same model without the draft (the verifier alone, or vLLM's n-gram
drafting). At each concurrency, each endpoint in turn gets the same requests.

``--serve`` starts the two servers here instead, one at a time, so that on a machine of few cores neither takes the
other's: the draft server (``eaglenest serve``'s command, :func:`eaglenest.commands.serve.command.build_command`,
with the K-per-batch-size schedule of ``--schedule`` where it is of this draft) and the baseline server
(``--baseline``: ``none``, the verifier alone, or ``ngram``), each on 127.0.0.1:``--port``, waited for until
``/v1/models`` answers (``--server-timeout``), warmed up, run through whole rounds at every concurrency, then
stopped. Each runs as a subprocess in its own process group (SIGTERM to the group, SIGKILL after ``STOP_GRACE_S``:
:mod:`eaglenest.commands.supervised`), its output in ``raw/server-<role>.log`` (``-2``, ``-3`` for later starts),
and is stopped whatever ends the bench: the last run, a refusal, Ctrl-C or SIGTERM; a bench killed with SIGKILL
takes its server's whole process tree with it. Flags after ``--`` go to both servers.

**Rounds and intervals.** Requests at concurrency C share every step, and a slow spell of the machine slows a whole
run, so a run, not a request, is the unit of the speed-up's interval there. ``--rounds R`` (default 3) pairs R runs of
the draft with R of the baseline at every concurrency: with two URLs, the two runs of a pair follow each other and
which goes first alternates by round; with ``--serve``, servers take turns in whole rounds,
:func:`~eaglenest.commands.bench.schedule.server_blocks` (3 rounds: draft | baseline, baseline | draft, draft |
baseline: 4 server starts), so a drift of the machine over the bench falls on both sides and cancels over the
pairs rather than landing in the ratio as it would with one server's whole sweep before the other's. A
concurrency's speed-up is the geometric mean of its rounds' ratios, its 95% interval Student's t over their
logarithms (:func:`~eaglenest.commands.bench.figures.rounds_interval`; R - 1 degrees of freedom, so 3 rounds give
t = 4.3: honest about how little 3 runs say, and 5 rounds halve it). Each side's figures (tokens/s, latency, tau) are
pooled over its runs. What it costs on 2 CPU cores with the default 64 requests of 64 tokens and concurrency 1 4 16:
a round is about 200 s per server (concurrency 1 alone about 130 s), a server start a minute, so the default 3 rounds
take about 25 minutes against 9 for one; ``--rounds 1`` gives today's single table without intervals.

**K per batch size** (:mod:`eaglenest.commands.bench.schedule`): from the intervals, where speculation pays and where
it stops, as vLLM's ``num_speculative_tokens_per_batch_size``. With ``--serve`` and the draft served at one K at every
batch size (no record of this draft at that K in ``--schedule``, or ``--measure-schedule``), it is written to
``--schedule`` (:mod:`eaglenest.artifacts.serve_schedule`), which ``eaglenest serve`` then reads; where the draft
server served a schedule, the run checks it instead (the speed-ups it gives, and no draft counted at a concurrency the
schedule gives K 0 up to: vLLM following it step by step).

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

Results go to ``--out``: ``bench.json`` (rewritten after every run, atomically), ``speedup.png`` and
``raw/`` (vLLM's result files and logs, and the started servers' logs). ``stops_paying_at`` is the lowest
concurrency whose speed-up (draft tokens/s over baseline tokens/s) is below 1; ``schedule``, the K per batch size.
At concurrency 1 a row also holds ``single_stream_speedup``: the same ratio over the requests' own seconds (of every
round, paired within it) with its 95% interval over requests, the measurement kit's
(:mod:`eaglenest.core.measure.speedup`), as evaluate and the k_sweep stage report it; it leaves out the drift between
the two runs, which the interval over rounds takes in.
Exit status: 0; 1 when a request failed or an output at temperature 0 differs beyond a near-tie; 2 on a refusal
(one line): an unreachable server,
one that serves another model, a draft server without spec-decode counters, a prompts file in none of the
formats, a started server that exits or stays silent before it answers (naming its log), or a server that stops
answering mid-run (the concurrencies measured before stay in bench.json).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.artifacts.serve_schedule import Schedule, k_at
from eaglenest.commands.bench.config import BenchConfig
from eaglenest.commands.bench.counters import acceptance, counter_problems
from eaglenest.commands.bench.endpoint import Endpoint, ServerGone
from eaglenest.commands.bench.figures import (
    endpoint_figures,
    pooled_raw,
    rounds_interval,
    single_stream_speedup,
    stops_paying_at,
)
from eaglenest.commands.bench.load import RunStopped, run_vllm_bench
from eaglenest.commands.bench.outputs import Comparison, Replay, ask_with_logprobs, compare_outputs, judge_difference
from eaglenest.commands.bench.render import write_result
from eaglenest.commands.bench.servers import StartedServer
from eaglenest.core.errors import EaglenestError
from eaglenest.core.measure.spec_counters import SpecCounts

# A server that stopped answering mid-run may be dying: how long to wait for its exit status, for the message.
SERVER_EXIT_WAIT_S = 2.0


@dataclass(frozen=True)
class Run:
    """One endpoint's run at one concurrency in one round: its figures, vLLM's result, and the counters' difference."""

    figures: dict[str, Any]
    raw: dict[str, Any]
    spec: SpecCounts | None


class Sweep:
    """One bench's measurements: its requests, bench.json as measured so far, and the temperature-0 checks.

    Args:
        config: The flags.
        result: bench.json's contents, filled as the sweep goes.
        dataset: The requests file ``vllm bench serve`` reads.
        prompts: Token ids of each prompt; request i is prompt i mod P.
        prompt_ids: Each prompt's id in the prompts file.
        tokenizer: The served model's, for the near-tie check.
        schedule: The K per batch size the draft server serves (None: one K at every batch size), and that K:
            at a concurrency where it gives K 0 at every batch size, the counters must not grow.
    """

    def __init__(
        self,
        config: BenchConfig,
        result: dict[str, Any],
        dataset: Path,
        prompts: list[list[int]],
        prompt_ids: list[str],
        tokenizer: Any,
        schedule: tuple[Schedule, int] | None = None,
    ) -> None:
        self.config, self.result, self.dataset = config, result, dataset
        self.prompts, self.prompt_ids, self.tokenizer = prompts, prompt_ids, tokenizer
        self.schedule = schedule
        self.raw_dir = config.out / "raw"
        self.failed = 0
        self.real_differences = 0
        self.replays: dict[int, Replay | str] = {}  # by prompt: one check per prompt, whatever the concurrency
        self.servers: dict[str, StartedServer] = {}  # by role, with --serve
        self.runs: dict[tuple[str, int, int], Run] = {}  # by (role, round, concurrency)
        self.outputs: dict[tuple[int, int], dict[str, Any]] = {}  # by (round, concurrency): the temperature-0 check

    @property
    def model(self) -> str:
        return str(self.result["model"])

    @property
    def rounds(self) -> int:
        return self.config.rounds

    def write(self) -> None:
        levels = self.result["concurrency"]
        self.result["results"] = [self.row(c) for c in levels if any(key[2] == c for key in self.runs)]
        self.result["stops_paying_at"] = stops_paying_at(self.result["results"])
        write_result(self.result, self.config.out)

    def stop(self, endpoint: Endpoint, concurrency: int | str, why: str) -> EaglenestError:
        """The one-line error of a run that could not finish, bench.json written with what was measured."""
        self.write()
        rows = self.result["results"]
        measured = [r["concurrency"] for r in rows if r["speedup"] is not None]
        alone = {
            role: [r["concurrency"] for r in rows if r["speedup"] is None and r[role] is not None]
            for role in ("draft", "baseline")
        }  # --serve: the other server has not run there yet
        kept = [f"concurrency {measured}"] if measured else []
        kept += [f"the {role}'s figures at concurrency {levels}" for role, levels in alone.items() if levels]
        kept_text = ("bench.json keeps " + " and ".join(kept)) if kept else "nothing was measured"
        if measured and self.rounds > 1:
            kept_text += " (the rounds measured)"
        where = str(self.config.out / "bench.json")
        if endpoint.role in self.servers:
            where += f"; server log: {self.servers[endpoint.role].log}"
        message = (
            f"{endpoint.flag} {endpoint.url}: the run at concurrency {concurrency} did not finish: {why}; "
            f"{kept_text} ({where})"
        )
        self.result["stopped"] = message
        self.write()
        return EaglenestError(message)

    def _gone(self, endpoint: Endpoint, reason: str) -> str:
        """Why an endpoint stopped answering: the connection's error, and a started server's exit status."""
        server = self.servers.get(endpoint.role)
        status = None if server is None else server.exit_status(wait_s=SERVER_EXIT_WAIT_S)
        return f"the server stopped answering ({reason})" + (f"; it exited with {status}" if status is not None else "")

    def warm_up(self, endpoint: Endpoint) -> None:
        """An unmeasured run of ``--warmup-prompts`` requests; refuses an endpoint that fails every one."""
        if not self.config.warmup_prompts:
            return
        print(f"eaglenest bench: warming up {endpoint.role} ({endpoint.url})", flush=True)
        requests = min(self.config.warmup_prompts, self.result["prompts"]["requests"])
        try:
            warm = run_vllm_bench(
                endpoint, self.model, self.dataset, requests, 1, self.config, self.raw_dir, f"warmup-{endpoint.role}"
            )
        except RunStopped as err:
            raise self.stop(endpoint, "1 (warm-up)", str(err)) from None
        if not warm.get("completed"):  # a server that refuses every request: say why before the sweep
            why = endpoint_figures(warm, None, [], "").get("first_error", "no response")
            raise self.stop(endpoint, "1 (warm-up)", f"every request failed: {why}")

    def _raw_name(self, role: str, concurrency: int, number: int) -> str:
        return f"{role}-c{concurrency}" + (f"-r{number + 1}" if self.rounds > 1 else "")

    def measure(self, endpoint: Endpoint, concurrency: int, number: int = 0) -> None:
        """One endpoint's run at one concurrency in round ``number`` (from 0), kept in :attr:`runs`."""
        name = self._raw_name(endpoint.role, concurrency, number)
        requests = self.result["prompts"]["requests"]
        which = f", round {number + 1} of {self.rounds}" if self.rounds > 1 else ""
        print(f"eaglenest bench: {endpoint.role} at concurrency {concurrency} ({requests} requests{which})", flush=True)
        try:
            before = endpoint.counters()
            raw = run_vllm_bench(
                endpoint, self.model, self.dataset, requests, concurrency, self.config, self.raw_dir, name
            )
            after = endpoint.counters()
        except ServerGone as err:
            raise self.stop(endpoint, concurrency, self._gone(endpoint, err.reason)) from None
        except (RunStopped, EaglenestError) as err:
            raise self.stop(endpoint, concurrency, str(err).removeprefix(f"{endpoint.flag} {endpoint.url}: ")) from None
        spec = acceptance(before, after)
        expected, forbidden = self._drafts_expected(endpoint.role, concurrency)
        problems = counter_problems(before, after, spec, raw, spec_expected=expected)
        if forbidden and spec is not None and spec.drafts > 0:
            problems.append(
                f"{spec.drafts} drafts at concurrency {concurrency}, where the served schedule gives K 0 "
                f"at every batch size up to {concurrency}: vLLM did not follow it step by step"
            )
        self.failed += int(raw["failed"])
        self.runs[(endpoint.role, number, concurrency)] = Run(
            endpoint_figures(raw, spec, problems, f"raw/{name}.json"), raw, spec
        )

    def _drafts_expected(self, role: str, concurrency: int) -> tuple[bool, bool]:
        """(every step should draft, no step may draft) for a run of ``role`` at ``concurrency``: at C requests in
        flight a step's batch is C at most (fewer as a run drains), so the schedule's K at batch sizes 1..C decide."""
        if role != "draft":
            return False, False
        if self.schedule is None:
            return True, False
        schedule, k = self.schedule
        ks = [k_at(schedule, batch, k) for batch in range(1, concurrency + 1)]
        return min(ks) > 0, max(ks) == 0

    def settle(self, baseline: Endpoint | None) -> None:
        """The temperature-0 check of every round measured on both servers and not yet checked; with the baseline
        not answering (``None``: its server is stopped), those needing its near-tie replay wait for its next start.
        Then bench.json is written."""
        if self.config.temperature == 0:
            for role, number, concurrency in list(self.runs):
                key = (number, concurrency)
                draft, plain = self.runs.get(("draft", *key)), self.runs.get(("baseline", *key))
                if role != "draft" or key in self.outputs or draft is None or plain is None:
                    continue
                compared = compare_outputs(draft.raw, plain.raw, self.prompt_ids)
                if compared.differ and baseline is None:
                    continue  # its replays wait for the baseline's next start
                self.outputs[key] = self.check_outputs(concurrency, compared, draft.raw, baseline)
        self.write()

    def row(self, concurrency: int) -> dict[str, Any]:
        """One concurrency's line of bench.json from every round measured so far: each side's figures pooled over
        its runs, the speed-up over the rounds with both sides measured and its interval, the rounds themselves."""
        rounds, pairs = [], []
        for number in range(self.rounds):
            draft, plain = (self.runs.get((role, number, concurrency)) for role in ("draft", "baseline"))
            if draft is None and plain is None:
                continue
            ratio = None
            if draft is not None and plain is not None and plain.figures["tokens_per_s"] > 0:
                ratio = draft.figures["tokens_per_s"] / plain.figures["tokens_per_s"]
                pairs.append((number, draft, plain))
            rounds.append(
                {
                    "round": number + 1,
                    "speedup": None if ratio is None else round(ratio, 4),
                    "draft": None if draft is None else draft.figures,
                    "baseline": None if plain is None else plain.figures,
                    "outputs": self.outputs.get((number, concurrency)),
                }
            )
        interval = rounds_interval([(d.figures["tokens_per_s"], b.figures["tokens_per_s"]) for _, d, b in pairs])
        speedup = interval.value if interval is not None else (rounds[0]["speedup"] if len(pairs) == 1 else None)
        single = None
        if concurrency == 1 and pairs:
            single = single_stream_speedup(
                pooled_raw([d.raw for _, d, _ in pairs]), pooled_raw([b.raw for _, _, b in pairs])
            )
        return {
            "concurrency": concurrency,
            "speedup": None if speedup is None else round(speedup, 4),
            "speedup_interval": None if interval is None else interval.as_dict() | {"over": "rounds"},
            "single_stream_speedup": single.as_dict() if single is not None else None,
            "draft": self._pooled("draft", concurrency),
            "baseline": self._pooled("baseline", concurrency),
            "outputs": _pooled_outputs(rounds),
            "rounds": rounds,
        }

    def _pooled(self, role: str, concurrency: int) -> dict[str, Any] | None:
        """``role``'s figures at ``concurrency`` over all its rounds (one round: that run's own)."""
        runs = [(n, run) for (r, n, c), run in sorted(self.runs.items()) if r == role and c == concurrency]
        if not runs:
            return None
        if len(runs) == 1 and self.rounds == 1:
            return runs[0][1].figures
        specs = [run.spec for _, run in runs]
        spec = None if any(s is None for s in specs) else sum(specs, SpecCounts())  # type: ignore[arg-type]
        problems = [f"round {n + 1}: {p}" for n, run in runs for p in run.figures["counter_problems"]]
        return endpoint_figures(
            pooled_raw([run.raw for _, run in runs]), spec, problems, f"raw/{role}-c{concurrency}-r*.json"
        )

    def check_outputs(
        self, concurrency: int, compared: Comparison, draft: dict[str, Any], baseline_endpoint: Endpoint | None
    ) -> dict[str, Any]:
        """The temperature-0 check: identical texts, else the near-tie rule against the baseline's replay."""
        near_ties, differ = [], []
        for entry in compared.differ:
            request = entry["request"]
            assert baseline_endpoint is not None  # settle() waits for it where an output differs
            replay = self.replay(baseline_endpoint, request % len(self.prompts), concurrency)
            verdict = judge_difference(
                draft["generated_texts"][request], replay, self.tokenizer, self.result["tie_margin"]
            )
            (near_ties if verdict.near_tie else differ).append(entry | verdict.detail)
        self.real_differences += len(differ)
        return {
            "compared": compared.compared,
            "identical": compared.identical,
            "near_ties": near_ties,
            "differ": differ,
        }

    def replay(self, endpoint: Endpoint, prompt: int, concurrency: int) -> Replay | str:
        """The baseline's replay of one prompt (asked once per bench), or why there is none."""
        if prompt not in self.replays:
            self.result["tie_checks"] += 1
            try:
                self.replays[prompt] = ask_with_logprobs(
                    endpoint, self.model, self.prompts[prompt], self.config.max_tokens, self.config.timeout_s
                )
            except ServerGone as err:
                raise self.stop(
                    endpoint, concurrency, f"{self._gone(endpoint, err.reason)} during the near-tie check"
                ) from None
            except EaglenestError as err:
                why = str(err).removeprefix(f"{endpoint.flag} {endpoint.url}: ")
                self.replays[prompt] = f"the baseline's near-tie check failed: {why}"
        return self.replays[prompt]


def _pooled_outputs(rounds: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The rounds' temperature-0 checks summed (each entry of a later round names its round); None before any."""
    checked = [r for r in rounds if r["outputs"] is not None]
    if not checked:
        return None
    if len(rounds) == 1:
        return checked[0]["outputs"]
    pooled: dict[str, Any] = {"compared": 0, "identical": 0, "near_ties": [], "differ": []}
    for entry in checked:
        outputs = entry["outputs"]
        pooled["compared"] += outputs["compared"]
        pooled["identical"] += outputs["identical"]
        for key in ("near_ties", "differ"):
            pooled[key] += [item | {"round": entry["round"]} for item in outputs[key]]
    return pooled
