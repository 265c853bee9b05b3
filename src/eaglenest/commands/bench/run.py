"""``eaglenest bench`` from start to end: the checks, the prompts rendered, each endpoint (the two URLs, or the
servers ``--serve`` starts one at a time) measured at each concurrency in each round through a
:class:`~eaglenest.commands.bench.sweep.Sweep`, the result written and summed up. How the bench measures, and what
it writes: :mod:`eaglenest.commands.bench.sweep`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from eaglenest.commands.bench.config import BenchConfig, ServeSetup, check_config, default_tie_margin
from eaglenest.commands.bench.endpoint import (
    Endpoint,
    base_url,
    check_models,
    draft_model,
    require_model,
    require_spec_decode,
)
from eaglenest.commands.bench.prompts import bench_prompts_file, check_length, load_bench_tokenizer, render_prompts
from eaglenest.commands.bench.render import summary_lines
from eaglenest.commands.bench.schedule import schedule_result, server_blocks
from eaglenest.commands.bench.servers import SERVER_HOST, server_command, sigterm_as_exit, started_server
from eaglenest.commands.bench.sweep import Sweep
from eaglenest.core.atomic import atomic_write_bytes, remove_stale_temps
from eaglenest.core.errors import EaglenestError, InputFileError


def run_bench(config: BenchConfig) -> tuple[dict[str, Any], int]:
    """The sweep: checks, then each endpoint warmed up and measured at each concurrency in each round, the outputs
    compared, and the K per batch size read from the figures.

    With two URLs, both endpoints take turns at each concurrency (which goes first alternating by round); with
    ``--serve``, one server at a time runs whole rounds (:func:`~eaglenest.commands.bench.schedule.server_blocks`).

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
        commands = {
            role: server_command(config.serve, config.model, kind, cpu_build=build.kind == "cpu")
            for role, kind in (("draft", None), ("baseline", config.serve.baseline))
        }
        urls = (f"http://{SERVER_HOST}:{config.serve.port}",) * 2  # one port, one server at a time
    tokenizer, expected = load_bench_tokenizer(config.tokenizer_dir)
    if config.serve is None:
        served = check_models(draft, baseline, config.model, expected)
        require_spec_decode(draft, str(served["id"]))
    prompts = render_prompts(conversations, prompts_file, tokenizer)
    if served is not None:
        check_length(served, prompts, config)
    result = _new_result(
        config, f"vllm bench serve ({build.distribution} {build.version})", urls, served, prompts, commands
    )
    draft_command = commands.get("draft")
    scheduled = (
        None if draft_command is None or draft_command.schedule is None else (draft_command.schedule, draft_command.k)
    )
    sweep = Sweep(
        config,
        result,
        _write_requests(config, prompts, result["prompts"]["requests"]),
        prompts,
        [c.id for c in conversations],
        tokenizer,
        scheduled,
    )
    if config.serve is None:
        _sweep_urls(sweep, draft, baseline, result["concurrency"])
    else:
        with sigterm_as_exit():
            _sweep_servers(sweep, config.serve, commands, result["concurrency"])
    result["complete"] = True
    sweep.write()
    status = 1 if sweep.failed or sweep.real_differences else 0
    result["schedule"] = schedule_result(config, result, draft_command, status)
    sweep.write()
    return result, status


def _require_vllm() -> Any:
    """The installed vLLM build (:class:`eaglenest.core.vllm_support.VllmBuild`), whose ``vllm bench serve`` makes
    the load; one line where this interpreter has none."""
    from eaglenest.core.vllm_support import installed_build

    build = installed_build()
    if build is None:
        raise EaglenestError(
            f"eaglenest bench runs vLLM's `vllm bench serve`, and this interpreter "
            f"({sys.executable}) has no vLLM; install it (make setup) or run eaglenest from the "
            "environment that has it"
        )
    return build


def _url_endpoints(config: BenchConfig) -> tuple[Endpoint, Endpoint]:
    """The draft and baseline servers of ``--url`` and ``--baseline-url``, two servers that both answer."""
    draft = Endpoint("draft", "--url", base_url(str(config.url), "--url"))
    baseline = Endpoint("baseline", "--baseline-url", base_url(str(config.baseline_url), "--baseline-url"))
    if draft.url == baseline.url:
        raise EaglenestError(
            f"--url and --baseline-url are both {draft.url}: the baseline is another server, "
            "the same model without the draft (or with n-gram drafting)"
        )
    for endpoint in (draft, baseline):
        endpoint.get("/v1/models")  # both reachable before the tokenizer loads
    return draft, baseline


def _new_result(
    config: BenchConfig,
    tool: str,
    urls: tuple[str, str],
    served: dict[str, Any] | None,
    prompts: list[list[int]],
    commands: dict[str, Any],
) -> dict[str, Any]:
    """bench.json before the first run: what is measured, how, and on which prompts."""
    levels = sorted(set(config.concurrency))
    result: dict[str, Any] = {
        "url": urls[0],
        "baseline_url": urls[1],
        "model": None if served is None else str(served["id"]),
        "tool": tool,
        "prompts": {
            "file": str(config.prompts),
            "count": len(prompts),
            "requests": config.num_prompts or 4 * levels[-1],
            "tokens": [len(p) for p in prompts],
        },
        "max_tokens": config.max_tokens,
        "temperature": config.temperature,
        "concurrency": levels,
        "rounds": config.rounds,
        "tie_margin": default_tie_margin() if config.tie_margin is None else config.tie_margin,
        "tie_checks": 0,
        "results": [],
        "stops_paying_at": None,
        "schedule": None,
        "complete": False,
    }
    if config.serve is not None:
        result["servers"] = {
            role: {
                "kind": "draft" if role == "draft" else config.serve.baseline,
                "command": command.shell(),
                "why": command.k_reason,
                "log": f"raw/server-{role}.log",
                "starts": 0,
            }
            | (
                {
                    "schedule": None if command.schedule is None else [list(e) for e in command.schedule],
                    "schedule_why": command.schedule_reason,
                }
                if role == "draft"
                else {}
            )
            for role, command in commands.items()
        }
    return result


def _write_requests(config: BenchConfig, prompts: list[list[int]], num_requests: int) -> Path:
    """``--out`` cleared of an earlier run's leftovers, and the requests file ``vllm bench serve`` reads (request i
    is prompt i mod P)."""
    out, raw_dir = config.out, config.out / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)
    (out / "speedup.png").unlink(missing_ok=True)  # an earlier run's plot must not pass for this one's
    dataset = raw_dir / "requests.jsonl"  # `custom` reads only a .jsonl name
    atomic_write_bytes(
        dataset, "".join(json.dumps({"prompt": prompts[i % len(prompts)]}) + "\n" for i in range(num_requests)).encode()
    )
    return dataset


def _sweep_urls(sweep: Sweep, draft: Endpoint, baseline: Endpoint, levels: list[int]) -> None:
    """Both servers up: each warmed up, then in each round at each concurrency the draft's run and the baseline's,
    one right after the other, the draft first in odd rounds and second in even ones (a drift cancels)."""
    for endpoint in (draft, baseline):
        sweep.warm_up(endpoint)
    for number in range(sweep.rounds):
        for concurrency in levels:
            for endpoint in (draft, baseline) if number % 2 == 0 else (baseline, draft):
                sweep.measure(endpoint, concurrency, number)
            sweep.settle(baseline)  # each concurrency is kept as soon as it is measured


def _sweep_servers(sweep: Sweep, serve: ServeSetup, commands: dict[str, Any], levels: list[int]) -> None:
    """``--serve``: one server at a time, each started, checked, warmed up, run through its rounds at every
    concurrency and stopped (:func:`~eaglenest.commands.bench.schedule.server_blocks`: draft | baseline with one
    round; draft | baseline, baseline | draft, draft | baseline with three)."""
    out = sweep.config.out
    first: Endpoint | None = None
    starts = {"draft": 0, "baseline": 0}
    for role, numbers in server_blocks(sweep.rounds):
        starts[role] += 1
        log = out / "raw" / (f"server-{role}.log" if starts[role] == 1 else f"server-{role}-{starts[role]}.log")
        if "servers" in sweep.result:
            sweep.result["servers"][role]["starts"] = starts[role]
        with started_server(role, commands[role], serve, log) as server:
            sweep.servers[role] = server
            endpoint = Endpoint(role, f"the {role} server", server.url)
            if first is None:
                # the server answers to the name its command gave (--model, else the verifier's) and to the
                # verifier's path: the name is asked for, not guessed
                served = draft_model(endpoint, sweep.config.model, commands[role].served_name)
                sweep.result["model"] = str(served["id"])
                check_length(served, sweep.prompts, sweep.config)
                first = endpoint
            elif starts[role] == 1:
                require_model(endpoint, sweep.model, first)
            if role == "draft" and starts[role] == 1:
                require_spec_decode(endpoint, sweep.model)
            sweep.warm_up(endpoint)
            baseline = endpoint if role == "baseline" else None
            sweep.settle(baseline)  # the near-tie checks that waited for the baseline
            for number in numbers:
                for concurrency in levels:
                    sweep.measure(endpoint, concurrency, number)
                    sweep.settle(baseline)  # each run is kept as soon as it is measured


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
        print(
            f"eaglenest bench: {differ} outputs at temperature 0 differ from the baseline's beyond a near-tie "
            f"within --tie-margin {result['tie_margin']:g} (see {config.out / 'bench.json'})",
            file=sys.stderr,
        )
    return status
