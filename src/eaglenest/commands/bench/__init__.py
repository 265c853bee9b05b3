"""``eaglenest bench``: the served draft against a baseline server under concurrent load.

The package, by concern: ``config`` (the flags as a :class:`~eaglenest.commands.bench.config.BenchConfig` and their
checks), ``prompts`` (the prompts file rendered to token ids), ``servers`` (the servers ``--serve`` starts and
stops), ``endpoint`` (a server's HTTP API), ``load`` (``vllm bench serve``, the load and its timing), ``counters``
(``/metrics`` readings and acceptance), ``outputs`` (the temperature-0 check and its near-tie rule), ``figures``
(an endpoint's figures at one concurrency, and where speculation stops paying), ``render`` (bench.json, the
table, the plot), ``sweep`` (the runs measured, their rows and the outputs' check) and ``run`` (the bench from
start to end: the checks, the prompts, the endpoints swept, the result written). How the bench measures:
:mod:`eaglenest.commands.bench.sweep`.

This module declares the command; it imports the rest only when the command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from eaglenest.artifacts.serve_schedule import SCHEDULE_FILE
from eaglenest.commands.bench.config import (
    DEFAULT_CONCURRENCY,
    DEFAULT_OUT,
    DEFAULT_PORT,
    DEFAULT_ROUNDS,
    DEFAULT_SERVER_TIMEOUT_S,
    BenchConfig,
    ServeSetup,
)
from eaglenest.commands.command import Command
from eaglenest.core.errors import EaglenestError
from eaglenest.core.vllm_support import VLLM_DTYPES, VLLM_EXECUTIONS


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        default=None,
        help="the server with the draft (eaglenest serve, or vllm serve "
        "with --speculative-config), e.g. http://127.0.0.1:8000",
    )
    parser.add_argument(
        "--baseline-url", default=None, help="the server of the same model without the draft (or with n-gram drafting)"
    )
    parser.add_argument(
        "--serve",
        action="store_true",
        help="instead of --url and --baseline-url: start the "
        "draft server (eaglenest serve) and the baseline server here, one at a time on "
        "127.0.0.1:--port, each for whole rounds, the order alternating (logs in --out/raw)",
    )
    parser.add_argument(
        "--baseline",
        choices=["none", "ngram"],
        default=None,
        help="with --serve: the baseline server, the verifier alone (none) or with vLLM's n-gram "
        "drafting (ngram) (default: none)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=None,
        metavar="P",
        help=f"with --serve: the port both servers listen on, in turn (default: {DEFAULT_PORT})",
    )
    parser.add_argument(
        "--verifier",
        default=None,
        metavar="DIR",
        help="with --serve: the verifier stage's output folder (default: models/verifier)",
    )
    parser.add_argument(
        "--draft",
        default=None,
        metavar="DIR",
        help="with --serve: the train stage's draft checkpoint (default: models/draft)",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=VLLM_DTYPES,
        help="with --serve: the servers' compute dtype, as eaglenest serve's (default: auto)",
    )
    parser.add_argument(
        "--execution",
        default=None,
        choices=VLLM_EXECUTIONS,
        help="with --serve: the servers' models compiled or eager, as eaglenest serve's (default: auto)",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        metavar="K",
        help="with --serve: drafts per verify step, as eaglenest serve's (default: the fastest "
        "K the k_sweep stage measured, else the draft's own)",
    )
    parser.add_argument(
        "--schedule",
        default=None,
        metavar="FILE",
        help="with --serve: the K-per-batch-size record; the draft server is served with it where it "
        "is of this draft at the K served (the run then checks it), else at one K at every batch "
        f"size, and the schedule read from the run is written there (default: {SCHEDULE_FILE})",
    )
    parser.add_argument(
        "--measure-schedule",
        action="store_true",
        default=None,
        help="with --serve: serve the draft at one K at every batch size even where --schedule holds "
        "a schedule for it, and write the one read from this run over it",
    )
    parser.add_argument(
        "--server-timeout",
        type=float,
        default=None,
        metavar="S",
        help="with --serve: seconds a started server may take to answer /v1/models (default: "
        f"{DEFAULT_SERVER_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--prompts",
        required=True,
        metavar="FILE",
        help="JSONL of {'messages': [...]}, "
        "{'prompt': '...'} or question.jsonl {'turns': [...]} records (first turn asked), or one "
        "of evaluate's shipped sets: builtin:humaneval, builtin:general, builtin:long (the same "
        "prompt tokens evaluate decodes)",
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="NAME",
        help="the served model name (default: the "
        "verifier's name with --tokenizer models/verifier, else the one model --url serves); with "
        "--serve, the name the servers serve it under",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="renders the prompts to "
        "token ids with its chat template: the verifier stage's folder or the served model's "
        "(default: --verifier's folder, models/verifier)",
    )
    parser.add_argument(
        "--concurrency",
        nargs="+",
        type=int,
        default=DEFAULT_CONCURRENCY,
        metavar="C",
        help=f"requests in flight, one run per value and endpoint (default: {' '.join(map(str, DEFAULT_CONCURRENCY))})",
    )
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        metavar="N",
        help="requests per run, the prompts taken in turn (default: 4 x the highest concurrency)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=DEFAULT_ROUNDS,
        metavar="R",
        help="paired runs of both servers at every concurrency, the order alternating; 2 or more give "
        "the speed-up an interval at every concurrency, which the schedule needs (default: "
        f"{DEFAULT_ROUNDS})",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=64, metavar="M", help="tokens generated per request (default: 64)"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="sampling temperature; 0 also checks the outputs equal the baseline's (default: 0)",
    )
    parser.add_argument(
        "--tie-margin",
        type=float,
        default=None,
        metavar="X",
        help="at temperature 0, an output that leaves the baseline's where the draft's token is "
        "among the baseline's top candidates at most X below its best log-prob is a near-tie, "
        "not a difference (default: evaluate.bf16_tie_margin's default)",
    )
    parser.add_argument(
        "--warmup-prompts",
        type=int,
        default=2,
        metavar="N",
        help="requests of an unmeasured warm-up run per endpoint; 0: none (default: 2)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds one run may take before the bench stops (default: 600)",
    )
    parser.add_argument(
        "--out",
        default=str(DEFAULT_OUT),
        metavar="DIR",
        help=f"bench.json, speedup.png and vLLM's raw results (default: {DEFAULT_OUT})",
    )


# bench's flags that only say how --serve starts the servers; None: not given.
BENCH_SERVE_FLAGS = {
    "baseline": "--baseline",
    "port": "--port",
    "verifier": "--verifier",
    "draft": "--draft",
    "dtype": "--dtype",
    "execution": "--execution",
    "num_speculative_tokens": "--num-speculative-tokens",
    "server_timeout": "--server-timeout",
    "schedule": "--schedule",
    "measure_schedule": "--measure-schedule",
}


def _run(args: argparse.Namespace) -> int:
    from eaglenest.commands.bench.run import bench

    serve = None
    if args.serve:
        given = {key: getattr(args, key) for key in BENCH_SERVE_FLAGS if getattr(args, key) is not None}
        for key in ("verifier", "draft", "schedule"):
            if key in given:
                given[key] = Path(given[key])
        if "server_timeout" in given:
            given["timeout_s"] = given.pop("server_timeout")
        serve = ServeSetup(**given, vllm_args=tuple(args.passthrough_args))
    else:
        stray = [flag for key, flag in BENCH_SERVE_FLAGS.items() if getattr(args, key) is not None]
        if args.passthrough_args:
            stray.append("flags after --")
        if stray:
            raise EaglenestError(
                f"{', '.join(stray)}: only with --serve (they say how bench starts the servers); "
                "add --serve, or drop them to benchmark --url and --baseline-url"
            )
    return bench(
        BenchConfig(
            args.url,
            args.baseline_url,
            Path(args.prompts),
            model=args.model,
            tokenizer=None if args.tokenizer is None else Path(args.tokenizer),
            concurrency=tuple(args.concurrency),
            num_prompts=args.num_prompts,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            warmup_prompts=args.warmup_prompts,
            timeout_s=args.timeout,
            out=Path(args.out),
            tie_margin=args.tie_margin,
            serve=serve,
            rounds=args.rounds,
        )
    )


COMMAND = Command(
    "bench",
    help="the served draft against a baseline server under load: tokens/s, latency, tau and speed-up "
    "at each concurrency, with vLLM's `vllm bench serve`",
    description="Benchmark the served draft against a baseline server (the same model without the draft, or "
    "with n-gram drafting) at each concurrency: tokens/s, latency and TTFT from vLLM's `vllm bench serve`, tau "
    "and per-position acceptance from the server's /metrics, the speed-up with its 95% interval over --rounds "
    "paired runs, the concurrency at which speculation stops paying, the K per batch size that follows (with "
    "--serve written to --schedule, which eaglenest serve reads) and, at temperature 0, whether the outputs equal "
    "the baseline's (or leave it at a near-tie). Either both servers are running (--url, --baseline-url), or "
    "--serve starts them here, one at a time (flags after -- go to both). Writes bench.json and speedup.png.",
    add_arguments=_add_arguments,
    run=_run,
    passes_flags=True,
)
