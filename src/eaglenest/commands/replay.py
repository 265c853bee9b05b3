"""``eaglenest replay FILE --url URL``: send a file's prompts to a server as chat requests, several at a time.

What a team's clients would send, from a file: a mix written for a test, or traffic recorded by ``eaglenest serve
--record`` (a folder, or one of its files) sent again, to another draft or to a server that records it. Each record
becomes one ``/v1/chat/completions`` request, read as evaluation sets are read
(:mod:`eaglenest.artifacts.eval_prompts`): a ``{"messages": [...]}`` record ending in a user message (a recorded
line, an evaluation set's), a ``{"prompt": "..."}`` record as one user message, a question.jsonl record's first
turn. Replies are greedy unless ``--temperature``; the line printed at the end counts answers and failures and
gives the mean acceptance the server reported (vLLM's ``metrics.speculative_decoding``, where it reports one). Any
failed request makes the exit status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from eaglenest.commands.command import Command
from eaglenest.core.errors import EaglenestError, InputFileError

DEFAULT_TIMEOUT_S = 600.0


def replay_messages(source: Path) -> list[list[dict[str, Any]]]:
    """The chat messages of each request a file (or a traffic folder's chat lines) holds, in order.

    Raises:
        InputFileError: an unreadable file, or a record in none of the formats (its file and line).
    """
    if source.is_dir():
        from eaglenest.artifacts.traffic.records import read_traffic

        log = read_traffic(source, f"replay {source}")
        return [list(r.record.messages or []) for r in log.requests if r.record.endpoint == "chat"]
    from eaglenest.artifacts.eval_prompts import read_jsonl_conversations

    conversations = read_jsonl_conversations(source, "replay")
    if not conversations:
        raise InputFileError(f"replay: {source}: no records")
    return [[*c.context, {"role": "user", "content": c.turns[0]}] for c in conversations]


def replay(
    source: Path,
    url: str,
    concurrency: int,
    max_tokens: int,
    temperature: float,
    model: str | None,
    num_prompts: int | None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dict[str, Any]:
    """Sends every request of ``source`` to ``url``, ``concurrency`` at a time; returns what happened.

    Raises:
        EaglenestError: a bad flag, an unreadable file, or a server that does not answer ``/v1/models``.
    """
    from eaglenest.commands.bench.endpoint import Endpoint, base_url

    if concurrency < 1:
        raise EaglenestError(f"--concurrency {concurrency}: expected at least 1")
    if max_tokens < 1:
        raise EaglenestError(f"--max-tokens {max_tokens}: expected at least 1")
    requests = replay_messages(source)[:num_prompts]
    endpoint = Endpoint("server", "--url", base_url(url, "--url"))
    listed = list(endpoint.models())
    if model is not None and model not in listed:
        raise EaglenestError(f"--model {model}: {url} serves {listed}; name one of them")
    served = model or listed[0]  # vLLM lists the served name first, then the weights' path it also answers to

    def send(messages: list[dict[str, Any]]) -> tuple[str | None, float | None]:
        body = {"model": served, "messages": messages, "max_tokens": max_tokens, "temperature": temperature}
        try:
            answer = endpoint.post("/v1/chat/completions", body, timeout_s)
        except EaglenestError as err:
            return str(err), None
        spec = ((answer or {}).get("metrics") or {}).get("speculative_decoding") or {}
        return None, spec.get("mean_acceptance_length")

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(send, requests))
    seconds = time.perf_counter() - started
    failures = [error for error, _ in results if error is not None]
    acceptance = [tau for error, tau in results if error is None and tau is not None]
    return {
        "requests": len(results),
        "answered": len(results) - len(failures),
        "failed": len(failures),
        "first_failure": failures[0] if failures else None,
        "seconds": round(seconds, 3),
        "requests_per_s": round(len(results) / seconds, 3) if seconds else None,
        "mean_acceptance_length": round(sum(acceptance) / len(acceptance), 4) if acceptance else None,
        "concurrency": concurrency,
    }


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source", metavar="FILE", help="a JSONL file of prompts, or a folder eaglenest serve --record wrote"
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: http://127.0.0.1:8000)")
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight at once (default: 1)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default: 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    parser.add_argument("--model", default=None, help="the served model to ask (default: the server's only model)")
    parser.add_argument("--num-prompts", type=int, default=None, help="send the first N only (default: all)")


def _run(args: argparse.Namespace) -> int:
    result = replay(
        Path(args.source), args.url, args.concurrency, args.max_tokens, args.temperature, args.model, args.num_prompts
    )
    print(json.dumps(result))
    if result["failed"]:
        print(
            f"eaglenest replay: {result['failed']} of {result['requests']} requests failed: {result['first_failure']}",
            file=sys.stderr,
        )
        return 1
    return 0


COMMAND = Command(
    "replay",
    help="send a file's prompts (or recorded traffic) to a server as chat requests, several at a time",
    add_arguments=_add_arguments,
    run=_run,
)
