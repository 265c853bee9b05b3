"""The load and its timing: one ``vllm bench serve`` run per concurrency and endpoint, in a process of its own."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from eaglenest.commands.bench.config import BenchConfig
from eaglenest.commands.bench.endpoint import Endpoint, api_key, printable

# `vllm bench serve` exactly as vLLM's CLI runs it (BenchmarkServingSubcommand.cmd is main(args)), without the
# CLI's top-level parser, which fails on the CPU build (see :mod:`eaglenest.commands.bench.sweep`).
BENCH_LAUNCHER = (
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "parser = FlexibleArgumentParser(prog='vllm bench serve'); add_cli_args(parser); main(parser.parse_args())"
)


class RunStopped(Exception):
    """A ``vllm bench serve`` run or a reading around it could not finish: the message says why."""


def run_vllm_bench(
    endpoint: Endpoint,
    model: str,
    dataset: Path,
    num_requests: int,
    concurrency: int,
    config: BenchConfig,
    raw_dir: Path,
    name: str,
) -> dict[str, Any]:
    """One ``vllm bench serve`` run; its result file's contents.

    Raises:
        RunStopped: it exited non-zero, ran past ``--timeout``, or left no result.
    """
    result_file = raw_dir / f"{name}.json"
    log_file = raw_dir / f"{name}.log"
    result_file.unlink(missing_ok=True)  # a stale file from an earlier run must not pass for this one's
    argv = [
        sys.executable,
        "-c",
        BENCH_LAUNCHER,
        "--backend",
        "openai",
        "--endpoint",
        "/v1/completions",
        "--base-url",
        endpoint.url,
        "--model",
        model,
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(dataset),
        "--disable-shuffle",
        "--no-oversample",
        "--skip-tokenizer-init",
        "--num-prompts",
        str(num_requests),
        "--max-concurrency",
        str(concurrency),
        "--temperature",
        str(config.temperature),
        "--extra-body",
        json.dumps({"max_tokens": config.max_tokens}),
        "--percentile-metrics",
        "e2el",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
        "--seed",
        "0",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(raw_dir),
        "--result-filename",
        result_file.name,
    ]
    # `vllm bench serve` sends OPENAI_API_KEY as its bearer token: bench's key, and never a key for another service
    env = {name: value for name, value in os.environ.items() if name != "OPENAI_API_KEY"}
    key = api_key()
    if key:
        env["OPENAI_API_KEY"] = key
    try:
        with log_file.open("w") as log:
            done = subprocess.run(
                argv, stdout=log, stderr=subprocess.STDOUT, timeout=config.timeout_s, check=False, env=env
            )
    except subprocess.TimeoutExpired:
        raise RunStopped(f"ran past --timeout {config.timeout_s:g} s (log: {log_file})") from None
    if done.returncode != 0:
        raise RunStopped(
            f"vllm bench serve exited with {done.returncode}: "
            f"{failure_line(log_file.read_text(errors='replace'))} (log: {log_file})"
        )
    try:
        return json.loads(result_file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise RunStopped(
            f"vllm bench serve left no result in {result_file} ({type(err).__name__}; log: {log_file})"
        ) from None


def failure_line(log: str) -> str:
    """The line of a run's log that says why it failed: the exception's, else the last one.

    The exception's line is looked for because the interpreter's exit may print more after it (nanobind's leak
    report, from the triton that vLLM imports).
    """
    lines = [text for line in log.splitlines() if (text := printable(line))]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", line)]
    return (errors or lines or ["no output"])[-1][:300]
