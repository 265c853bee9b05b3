"""`eaglenest bench` against fake OpenAI-compatible servers on 127.0.0.1 (no vLLM engine starts): the /metrics
arithmetic, the refusals (one line, exit 2), the near-tie rule on differing outputs, servers started by --serve
(the fake run as a process: ``python -m tests.fixtures.fakes --port P ...``) and, slow, whole sweeps run by
`vllm bench serve` itself."""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from eaglenest.artifacts.serve_schedule import MeasuredPoint
from eaglenest.commands import cli
from eaglenest.commands.bench import run as bench_run
from eaglenest.commands.bench import sweep
from eaglenest.commands.bench.config import BenchConfig, ServeSetup
from eaglenest.commands.bench.counters import acceptance, acceptance_json, counter_problems
from eaglenest.commands.bench.endpoint import ERROR_BODY_BYTES, MAX_RESPONSE_BYTES, Endpoint, base_url
from eaglenest.commands.bench.figures import T_975, rounds_interval, stops_paying_at
from eaglenest.commands.bench.load import run_vllm_bench
from eaglenest.commands.bench.outputs import (
    Replay,
    Verdict,
    compare_outputs,
    draft_divergence,
    judge_difference,
    parse_replay,
)
from eaglenest.commands.bench.prompts import bench_prompts_file
from eaglenest.commands.bench.schedule import derive_schedule, measured_points, pays, server_blocks
from eaglenest.commands.bench.servers import server_command
from eaglenest.commands.serve.command import ServeCommand
from eaglenest.core.errors import EaglenestError
from eaglenest.core.lossless_rule import TIE_CANDIDATES
from eaglenest.core.measure.spec_counters import (
    ACCEPTED,
    DRAFT_TOKENS,
    DRAFTS,
    GENERATION_TOKENS,
    MetricsReading,
    SpecCounts,
    parse_metrics,
)
from tests.fixtures.bench import BenchSweep, schedule_record, write_bench_prompts
from tests.fixtures.fakes import LETTERS, TOP_GAP, FakeServer, fake_letters, letter_ids
from tests.fixtures.models import build_tiny_tokenizer
from tests.fixtures.pipeline import REPO


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    build_tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    return write_bench_prompts(tmp_path / "prompts.jsonl")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_args(draft: str, baseline: str, prompts: Path, tokenizer: Path, out: Path, *extra: str) -> list[str]:
    return [
        "bench",
        "--url",
        draft,
        "--baseline-url",
        baseline,
        "--prompts",
        str(prompts),
        "--tokenizer",
        str(tokenizer),
        "--out",
        str(out),
        *extra,
    ]


def one_line_refusal(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    status = cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert status == 2, err
    assert err.startswith("eaglenest bench: error: ") and "\n" not in err, err
    return err


# --- /metrics ---------------------------------------------------------------------------------------------------

VLLM_METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 7.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 3.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 19.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 6.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 4.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 40.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_metrics_are_read_with_the_prometheus_parser_summed_over_engines():
    counters = parse_metrics(VLLM_METRICS, "test")
    assert counters.spec == SpecCounts(10, 30, 19, [9, 6, 4])
    assert counters.totals[DRAFTS] == 10.0  # both engines; the _created timestamp is not a count
    assert counters.totals[ACCEPTED] == 19.0 and counters.totals[GENERATION_TOKENS] == 40.0
    assert counters.accepted_per_pos == {0: 9.0, 1: 6.0, 2: 4.0}
    assert "vllm:num_requests_running" not in counters.totals  # a gauge
    plain = parse_metrics(VLLM_METRICS.split("# HELP vllm:generation")[0].replace("spec_decode", "other"), "t")
    assert plain.spec is None


def test_tau_is_one_plus_accepted_over_drafts_between_two_readings():
    before = parse_metrics(VLLM_METRICS, "before")
    after = MetricsReading(
        {**before.totals, DRAFTS: 10.0 + 4, DRAFT_TOKENS: 30.0 + 12, ACCEPTED: 19.0 + 6},
        {0: 9.0 + 3, 1: 6.0 + 2, 2: 4.0 + 1},
    )
    spec = acceptance(before, after)
    assert spec == SpecCounts(drafts=4, draft_tokens=12, accepted=6, per_position=[3, 2, 1])
    figures = acceptance_json(spec)
    assert (figures["tau"], figures["per_position_acceptance"]) == (2.5, [0.75, 0.5, 0.25])
    raw = {"spec_decode_acceptance_length": 2.5, "total_output_tokens": 0, "completed": 0}
    assert counter_problems(before, after, spec, raw, spec_expected=True) == []
    # vLLM's own figure from the same counters disagreeing, or tokens the responses do not hold, are reported
    raw = {"spec_decode_acceptance_length": 2.4, "total_output_tokens": 5, "completed": 0}
    problems = counter_problems(before, after, spec, raw, spec_expected=True)
    assert len(problems) == 2 and "vLLM's bench read 2.4" in problems[1] and "grew by 0" in problems[0]
    assert acceptance(MetricsReading({}, {}), MetricsReading({}, {})) is None
    # per-position counts that do not add up, or that rise with the position, are reported too
    odd = MetricsReading(after.totals, {0: 9.0 + 1, 1: 6.0 + 3, 2: 4.0 + 1})
    problems = counter_problems(
        before,
        odd,
        acceptance(before, odd),
        {"spec_decode_acceptance_length": 2.5, "total_output_tokens": 0, "completed": 0},
        spec_expected=True,
    )
    assert problems == [
        f"{ACCEPTED}_per_pos sums to 5, but {ACCEPTED} grew by 6",
        "accepted tokens per position rise with the position: [1, 3, 1]",
    ]


@pytest.mark.parametrize(
    "flags, wanted",
    [
        (["--concurrency", "0", "2"], "--concurrency 0 2: every value must be at least 1"),
        (["--concurrency", "1", "8", "--num-prompts", "4"], "--num-prompts 4: below --concurrency 8"),
        (["--max-tokens", "0"], "--max-tokens 0: must be at least 1"),
    ],
)
def test_flags_that_cannot_make_a_sweep_are_refused(
    capsys, prompts: Path, tokenizer_dir: Path, tmp_path: Path, flags: list[str], wanted: str
):
    err = one_line_refusal(
        capsys, bench_args("http://127.0.0.1:9", "http://127.0.0.1:10", prompts, tokenizer_dir, tmp_path / "o", *flags)
    )
    assert wanted in err


def test_fake_server_metrics_parse_as_vllms():
    with FakeServer() as fake:
        fake.complete([1, 2, 3], 5)
        counters = Endpoint("draft", "--url", fake.url).counters()
    assert counters.totals[DRAFTS] == 2 and counters.totals[ACCEPTED] == 2
    assert counters.accepted_per_pos == {0: 2.0, 1: 0.0, 2: 0.0}


def test_speedup_stops_paying_at_the_lowest_concurrency_below_one():
    rows = [
        {"concurrency": 1, "speedup": 1.4},
        {"concurrency": 4, "speedup": 0.97},
        {"concurrency": 8, "speedup": 1.01},
        {"concurrency": 16, "speedup": 0.8},
    ]
    assert stops_paying_at(rows) == 4
    assert stops_paying_at(rows[:1]) is None


def test_outputs_are_compared_request_by_request_skipping_failures():
    draft = {"generated_texts": ["a", "b", "c", "d"], "errors": ["", "", "", "boom"]}
    baseline = {"generated_texts": ["a", "x", "c", "d"], "errors": ["", "", "", ""]}
    compared = compare_outputs(draft, baseline, ["p0", "p1", "p2"])
    assert (compared.compared, compared.identical, compared.differ) == (3, 2, [{"request": 1, "prompt": "p1"}])


def test_urls_are_reduced_to_the_server_root():
    assert base_url("http://127.0.0.1:8000/v1/", "--url") == "http://127.0.0.1:8000"
    assert base_url("http://host:1/prefix/v1", "--url") == "http://host:1/prefix"
    with pytest.raises(EaglenestError, match="--url localhost:8000"):
        base_url("localhost:8000", "--url")


# --- refusals: one line, exit 2 ---------------------------------------------------------------------------------


def test_an_unreachable_url_is_refused(capsys, prompts: Path, tokenizer_dir: Path, tmp_path: Path):
    with FakeServer(spec=False) as baseline:
        err = one_line_refusal(
            capsys,
            bench_args(f"http://127.0.0.1:{free_port()}", baseline.url, prompts, tokenizer_dir, tmp_path / "out"),
        )
    assert "--url http://127.0.0.1:" in err and "no server answers" in err


def test_a_server_of_another_model_is_refused(capsys, prompts: Path, tokenizer_dir: Path, tmp_path: Path):
    with FakeServer(model="tiny") as draft, FakeServer(model="other", spec=False) as baseline:
        err = one_line_refusal(capsys, bench_args(draft.url, baseline.url, prompts, tokenizer_dir, tmp_path / "o"))
        assert "--baseline-url" in err and "'other'" in err and "same model" in err
        err = one_line_refusal(
            capsys, bench_args(draft.url, baseline.url, prompts, tokenizer_dir, tmp_path / "o", "--model", "llama")
        )
        assert f"--url {draft.url} serves ['tiny'], not 'llama'" in err
    assert draft.requests == [] and baseline.requests == []


def test_a_draft_server_without_spec_decode_counters_is_refused(
    capsys, prompts: Path, tokenizer_dir: Path, tmp_path: Path
):
    with FakeServer(spec=False) as draft, FakeServer(spec=False) as baseline:
        err = one_line_refusal(capsys, bench_args(draft.url, baseline.url, prompts, tokenizer_dir, tmp_path / "o"))
    assert "vllm:spec_decode_* counters" in err and "--url" in err


@pytest.mark.parametrize(
    "content, wanted",
    [
        ('{"text": "no known field"}\n', "line 1: expected"),
        ('{"prompt": "fine"}\nnot json\n', "line 2: not valid JSON"),
        ("", "no prompts"),
    ],
)
def test_a_prompts_file_in_none_of_the_formats_is_refused(
    capsys, tmp_path: Path, tokenizer_dir: Path, content: str, wanted: str
):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    err = one_line_refusal(
        capsys, bench_args("http://127.0.0.1:9", "http://127.0.0.1:10", path, tokenizer_dir, tmp_path / "o")
    )
    assert "--prompts" in err and str(path) in err and wanted in err


def test_evaluates_shipped_sets_are_prompts_by_their_source_name(capsys, tmp_path: Path, tokenizer_dir: Path):
    from eaglenest.artifacts.eval_sets import GENERAL_SET_FILE, LONG_SET_FILE

    assert bench_prompts_file(Path("builtin:general")) == GENERAL_SET_FILE
    assert bench_prompts_file(Path("builtin:long")) == LONG_SET_FILE
    assert bench_prompts_file(Path("data/mine.jsonl")) == Path("data/mine.jsonl")
    err = one_line_refusal(
        capsys,
        bench_args("http://127.0.0.1:9", "http://127.0.0.1:10", Path("builtin:mtbench"), tokenizer_dir, tmp_path / "o"),
    )
    assert "--prompts builtin:mtbench" in err and "builtin:humaneval" in err


def test_the_same_server_twice_is_refused(capsys, prompts: Path, tokenizer_dir: Path, tmp_path: Path):
    err = one_line_refusal(
        capsys, bench_args("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000", prompts, tokenizer_dir, tmp_path / "o")
    )
    assert "both http://127.0.0.1:8000" in err


# --- whole sweeps, with vLLM's bench (each run starts a Python that imports vLLM: slow on 2 cores) -------------


@pytest.mark.slow
def test_a_sweep_writes_bench_json_and_the_plot(real_bench_sweep: BenchSweep):
    sweep = real_bench_sweep  # a warm-up, then 4 requests at concurrency 1 and 2 (REAL_SWEEP_FLAGS)
    assert sweep.status == 0, sweep.stderr + sweep.stdout
    # the token ids sent are the chat-templated first turns, request i being prompt i mod 3, on both servers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(sweep.tokenizer)
    first = tokenizer(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "hello there how are you today"}], tokenize=False, add_generation_prompt=True
        ),
        add_special_tokens=False,
    )["input_ids"]
    assert sweep.draft_requests[0]["prompt"] == first  # the warm-up's
    measured = sweep.draft_requests[1:]
    theirs = sweep.baseline_requests[1:]
    assert len(measured) == 8 and [r["prompt"] for r in measured[:4]] == [r["prompt"] for r in theirs[:4]]
    assert sorted(r["prompt"] for r in measured) == sorted(r["prompt"] for r in theirs)  # c2: in any order
    assert measured[3]["prompt"] == first and all(r["max_tokens"] == 5 and r["temperature"] == 0 for r in measured)
    out = sweep.out
    result = json.loads((out / "bench.json").read_text())
    assert result["complete"] and result["concurrency"] == [1, 2] and result["model"] == "tiny"
    assert result["prompts"]["count"] == 3 and result["prompts"]["requests"] == 4
    for row in result["results"]:
        d, b = row["draft"], row["baseline"]
        assert d["completed"] == b["completed"] == 4 and d["failed"] == b["failed"] == 0
        assert d["output_tokens"] == 20 and d["tau"] == 2.0 and d["tau_vllm"] == 2.0
        assert d["per_position_acceptance"] == [1.0, 0.0, 0.0] and d["drafts"] == 8
        assert d["counter_problems"] == [] and b["counter_problems"] == [] and "tau" not in b
        assert row["speedup"] == pytest.approx(d["tokens_per_s"] / b["tokens_per_s"], rel=1e-3)
        assert d["latency_ms"]["p50"] > 0 and d["ttft_ms"]["p99"] >= d["ttft_ms"]["p50"] > 0
        assert row["outputs"] == {"compared": 4, "identical": 4, "near_ties": [], "differ": []}
        assert (out / row["draft"]["raw"]).is_file()
    assert result["stops_paying_at"] == stops_paying_at(result["results"])
    assert result["tie_checks"] == 0 and sweep.baseline_checks == []  # identical outputs need no check
    assert (out / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "speed-up" in sweep.stdout and "wrote" in sweep.stdout


@pytest.mark.slow
def test_a_server_killed_mid_run_ends_the_bench_in_one_line_keeping_what_was_measured(
    capsys, prompts: Path, tokenizer_dir: Path, tmp_path: Path
):
    out = tmp_path / "out"
    # three requests per run: concurrency 1 completes on both, the draft dies at its first request at 2
    with FakeServer(die_after=3) as draft, FakeServer(spec=False) as baseline:
        status = cli.main(
            bench_args(
                draft.url,
                baseline.url,
                prompts,
                tokenizer_dir,
                out,
                "--concurrency",
                "1",
                "2",
                "--num-prompts",
                "3",
                "--max-tokens",
                "3",
                "--warmup-prompts",
                "0",
                "--rounds",
                "1",
            )
        )
    err = capsys.readouterr().err.strip()
    assert status == 2 and err.count("\n") == 0, err
    assert f"--url {draft.url}" in err and "concurrency 2" in err and "stopped answering" in err
    assert "keeps concurrency [1]" in err
    result = json.loads((out / "bench.json").read_text())
    assert not result["complete"] and [r["concurrency"] for r in result["results"]] == [1]
    assert result["stopped"] in err and (out / "speedup.png").is_file()


# --- the near-tie rule on outputs that differ (fast: the runs below send the requests themselves) -------------


def fake_vllm_bench(
    endpoint: Endpoint,
    model: str,
    dataset: Path,
    num_requests: int,
    concurrency: int,
    config: BenchConfig,
    raw_dir: Path,
    name: str,
) -> dict:
    """`vllm bench serve`'s result file, from the requests sent one at a time (no vLLM import: seconds, not
    minutes); a request the server does not answer is a failed one, as vLLM's bench counts it."""
    records = [json.loads(line) for line in dataset.read_text().splitlines()][:num_requests]
    before = endpoint.counters()
    texts, errors, latencies, lengths, tokens = [], [], [], [], 0
    start = time.perf_counter()
    for record in records:
        sent = time.perf_counter()
        body = json.dumps(
            {
                "model": model,
                "prompt": record["prompt"],
                "max_tokens": config.max_tokens,
                "temperature": config.temperature,
                "stream": True,
            }
        ).encode()
        request = urllib.request.Request(
            endpoint.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                events = [
                    json.loads(line[6:]) for line in response.read().decode().splitlines() if line.startswith("data: {")
                ]
        except (urllib.error.URLError, OSError) as err:
            texts.append("")
            errors.append(str(err))
            latencies.append(0.0)
            lengths.append(0)
            continue
        texts.append("".join(c["text"] for e in events for c in e["choices"]))
        lengths.append(next(e["usage"]["completion_tokens"] for e in events if e.get("usage")))
        tokens += lengths[-1]
        errors.append("")
        latencies.append(time.perf_counter() - sent)
    duration = time.perf_counter() - start
    spec = acceptance(before, endpoint.counters()) if not any(errors) else None
    failed = sum(bool(e) for e in errors)
    raw = {
        "completed": len(records) - failed,
        "failed": failed,
        "total_output_tokens": tokens,
        "duration": duration,
        "output_throughput": tokens / duration,
        "request_throughput": (len(records) - failed) / duration,
        "latencies": latencies,
        "ttfts": [latency / 2 for latency in latencies],
        "errors": errors,
        "output_lens": lengths,
        "generated_texts": texts,
        "spec_decode_acceptance_length": spec.tau if spec else None,
    }
    (raw_dir / f"{name}.json").write_text(json.dumps(raw))
    return raw


@pytest.fixture
def fast_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sweep, "run_vllm_bench", fake_vllm_bench)


@pytest.mark.parametrize(
    "flip_to, extra, status, kind",
    [
        (None, [], 0, "identical"),
        (1, [], 0, "near_ties"),  # the baseline's runner-up, TOP_GAP (0.3) behind its best: within 0.5
        (13, [], 1, "outside"),  # none of the baseline's top 5
        (1, ["--tie-margin", "0.2"], 1, "above"),  # the runner-up, but 0.3 is above the margin
    ],
)
def test_outputs_that_differ_are_judged_by_the_near_tie_rule_on_the_baselines_top_logprobs(
    capsys,
    fast_runs,
    prompts: Path,
    tokenizer_dir: Path,
    tmp_path: Path,
    flip_to: int | None,
    extra: list[str],
    status: int,
    kind: str,
):
    out = tmp_path / "out"
    with (
        FakeServer(flip_at=None if flip_to is None else 2, flip_to=flip_to or 0) as draft,
        FakeServer(spec=False) as baseline,
    ):
        got = cli.main(
            bench_args(
                draft.url,
                baseline.url,
                prompts,
                tokenizer_dir,
                out,
                "--concurrency",
                "1",
                "2",
                "--num-prompts",
                "6",
                "--max-tokens",
                "4",
                "--warmup-prompts",
                "1",
                "--rounds",
                "1",
                *extra,
            )
        )
        captured = capsys.readouterr()
        assert got == status, captured.err + captured.out
        checks = baseline.checks
    result = json.loads((out / "bench.json").read_text())
    assert result["complete"] and result["tie_margin"] == (0.2 if extra else 0.5)
    rows = [r["outputs"] for r in result["results"]]
    assert all(o["compared"] == 6 for o in rows)
    if kind == "identical":
        assert all(o["identical"] == 6 and o["near_ties"] == [] and o["differ"] == [] for o in rows)
        assert checks == [] and result["tie_checks"] == 0
        return
    # once per prompt (3), whatever the concurrency: the measured token ids, alone, with the top 5 log-probs
    assert result["tie_checks"] == 3 and len(checks) == 3
    assert sorted(c["prompt"] for c in checks) == sorted(draft.requests[1 + i]["prompt"] for i in range(3))
    assert all(
        c["max_tokens"] == 4
        and c["temperature"] == 0
        and c["logprobs"] == TIE_CANDIDATES
        and c["return_tokens_as_token_ids"]
        and not c["stream"]
        for c in checks
    )
    for outputs in rows:
        judged, other = (
            (outputs["near_ties"], outputs["differ"])
            if kind == "near_ties"
            else (outputs["differ"], outputs["near_ties"])
        )
        assert outputs["identical"] == 0 and len(judged) == 6 and other == []
        first = judged[0]
        assert first["request"] == 0 and first["prompt"] == "1" and first["position"] == 2
        plain = LETTERS[fake_letters(draft.requests[1]["prompt"], 4)[2]]  # request 0 is prompt "1"
        assert first["baseline_text"] == plain and first["baseline_token"] == letter_ids()[LETTERS.index(plain)]
        taken = LETTERS[(LETTERS.index(plain) + flip_to) % 26]  # the draft's letter there
        if kind == "outside":
            assert first["draft_token"] is None and first["gap"] is None and first["draft_text"].startswith(taken)
            assert first["why"] == "the draft's text there begins with none of the baseline's top 5 tokens"
        else:
            assert first["draft_text"] == taken and first["draft_token"] == letter_ids()[LETTERS.index(taken)]
            assert first["gap"] == pytest.approx(TOP_GAP) and first["rank"] == 1
        if kind == "above":
            assert first["why"] == "the gap 0.3 is above the margin 0.2"
    if kind == "near_ties":
        assert "6 outputs leave the baseline's at a near-tie within --tie-margin 0.5" in captured.out
        assert "gap 0.3" in captured.out and captured.err == ""
    else:
        assert "6 outputs differ from the baseline's beyond a near-tie" in captured.out
        assert "12 outputs at temperature 0 differ from the baseline's beyond a near-tie" in captured.err


def test_the_draft_text_is_placed_on_the_baselines_tokens():
    tokenizer = build_tiny_tokenizer()
    a, b, c, d, f = (letter_ids()[LETTERS.index(x)] for x in "abcdf")
    end = tokenizer.eos_token_id
    plain = [a, b, c, d, end]
    top = [[(t, -0.05), (n, -0.35), (end, -2.0)] for t, n in ((a, b), (b, c), (c, d), (d, f))] + [
        [(end, -0.01), (f, -0.2)]
    ]
    assert draft_divergence("abcd", plain, top, tokenizer) is None
    tie = draft_divergence("abdd", plain, top, tokenizer)
    assert (tie.position, tie.plain_token, tie.spec_token, tie.gap) == (2, c, d, pytest.approx(0.3))
    early = draft_divergence("ab", plain, top, tokenizer)  # the draft ended where plain went on
    assert (early.position, early.spec_token, early.gap) == (2, end, pytest.approx(1.95))
    longer = draft_divergence("abcdf", plain, top, tokenizer)  # plain ended, the draft went on
    assert (longer.position, longer.plain_token, longer.spec_token) == (4, end, f)
    past = draft_divergence("abcdzz", plain[:4], top, tokenizer)  # past plain's last token: no candidates
    assert (past.position, past.plain_token, past.gap) == (4, None, None)
    replay = Replay(plain, top, "abcd")
    assert judge_difference("abdd", replay, tokenizer, 0.5).near_tie
    assert judge_difference("abdd", replay, tokenizer, 0.1).detail["why"] == "the gap 0.3 is above the margin 0.1"
    assert "cannot be placed" in judge_difference("abdd", Replay(plain, top, "abce"), tokenizer, 0.5).detail["why"]
    assert judge_difference("abdd", "no replay", tokenizer, 0.5) == Verdict(False, {"why": "no replay"})
    with pytest.raises(ValueError, match="token_id:N"):
        parse_replay({"choices": [{"text": "a", "logprobs": {"tokens": ["a"], "top_logprobs": [{}]}}]})


def test_a_draft_text_that_reads_as_several_token_sequences_is_judged_by_its_near_tie_reading():
    """Only text comes back from the draft server, and a text can be more than one token sequence."""
    tokenizer = build_tiny_tokenizer()
    a, z, b = (letter_ids()[LETTERS.index(x)] for x in "azb")
    space, space_a, space_t, space_the = tokenizer.convert_tokens_to_ids(["Ġ", "Ġa", "Ġt", "Ġthe"])
    end = tokenizer.eos_token_id
    # the baseline wrote "a", " ", "z"; the draft wrote "a the": read on the baseline's tokens it took " " and then
    # "the", which the baseline never considered; read as " the" in place of " ", it parted at a near-tie
    plain = [a, space, z, end]
    top = [[(a, -0.05)], [(space, -0.05), (space_the, -0.35)], [(z, -0.05), (b, -0.35)], [(end, -0.01)]]
    replay = Replay(plain, top, "a z")
    assert draft_divergence("a the", plain, top, tokenizer).gap is None
    verdict = judge_difference("a the", replay, tokenizer, 0.5)
    judged = verdict.detail
    assert verdict.near_tie and (judged["position"], judged["draft_token"]) == (1, space_the)
    assert "read_from_text" in judged
    # at the divergence itself, " the" (2.0 below) and " t" (0.3 below) both fit the text: " t" then "he"
    plain = [a, space_a, end]
    top = [[(a, -0.05)], [(space_a, -0.05), (space_t, -0.35), (space_the, -2.05)], [(end, -0.01)]]
    verdict = judge_difference("a the", Replay(plain, top, "a a"), tokenizer, 0.5)
    judged = verdict.detail
    assert verdict.near_tie and judged["draft_token"] == space_t and judged["gap"] == pytest.approx(0.3)
    # a text no reading explains stays a difference
    assert not judge_difference("a bzz", Replay(plain, top, "a a"), tokenizer, 0.5).near_tie


# --- --serve: the servers started here, one after the other (the fake as a process) ----------------------------


def fake_serve_command(events: Path, **role_flags: list[str]):
    """A stand-in for server_command: the fake server process, on --port, writing start/stop times."""

    def command(serve: ServeSetup, model: str | None, baseline: str | None, cpu_build: bool) -> ServeCommand:
        role = "draft" if baseline is None else "baseline"
        # like eaglenest serve's, the fake answers to its served name and to a model path
        argv = [
            sys.executable,
            "-m",
            "tests.fixtures.fakes",
            "--port",
            str(serve.port),
            "--role",
            role,
            "--events",
            str(events),
            "--alias",
            "/models/tiny",
            *(["--plain"] if baseline is not None else []),
            *role_flags.get(role, []),
        ]
        return ServeCommand(argv, {"PYTHONPATH": str(REPO)}, f"the fake {role} server", model or "tiny")

    return command


def serve_args(port: int, prompts: Path, tokenizer: Path, out: Path, *extra: str) -> list[str]:
    return [
        "bench",
        "--serve",
        "--port",
        str(port),
        "--server-timeout",
        "120",
        "--prompts",
        str(prompts),
        "--tokenizer",
        str(tokenizer),
        "--out",
        str(out),
        *extra,
    ]


def read_events(path: Path) -> list[tuple[str, str]]:
    events = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    assert [e["t"] for e in events] == sorted(e["t"] for e in events)
    return [(e["role"], e["event"]) for e in events]


def test_serve_starts_the_draft_server_sweeps_stops_it_then_the_baseline(
    capsys, monkeypatch, fast_runs, prompts: Path, tokenizer_dir: Path, tmp_path: Path
):
    # The runs send the requests themselves (fast_runs): what is tested is the servers' lives around the sweep;
    # vLLM's own bench runs the sweep of test_a_sweep_writes_bench_json_and_the_plot.
    out, events, port = tmp_path / "out", tmp_path / "events.jsonl", free_port()
    # the draft takes the baseline's runner-up at token 1: a near-tie, judged against the baseline process
    monkeypatch.setattr(bench_run, "server_command", fake_serve_command(events, draft=["--flip-at", "1"]))
    status = cli.main(
        serve_args(
            port,
            prompts,
            tokenizer_dir,
            out,
            "--concurrency",
            "1",
            "2",
            "--num-prompts",
            "3",
            "--max-tokens",
            "4",
            "--warmup-prompts",
            "0",
            "--rounds",
            "1",
        )
    )
    captured = capsys.readouterr()
    assert status == 0, captured.err + captured.out
    # one server at a time, each for the whole sweep: the draft stopped before the baseline started
    assert read_events(events) == [("draft", "start"), ("draft", "stop"), ("baseline", "start"), ("baseline", "stop")]
    result = json.loads((out / "bench.json").read_text())
    assert result["complete"] and "stopped" not in result and result["model"] == "tiny"
    assert result["url"] == result["baseline_url"] == f"http://127.0.0.1:{port}"
    assert [r["concurrency"] for r in result["results"]] == [1, 2]
    for row in result["results"]:
        d, b = row["draft"], row["baseline"]
        assert d["completed"] == b["completed"] == 3 and d["failed"] == b["failed"] == 0
        assert d["tau"] == 2.0 and d["counter_problems"] == [] and b["counter_problems"] == [] and "tau" not in b
        assert row["speedup"] == pytest.approx(d["tokens_per_s"] / b["tokens_per_s"], rel=1e-3)
        outputs = row["outputs"]
        assert outputs["identical"] == 0 and outputs["differ"] == [] and len(outputs["near_ties"]) == 3
        assert all(t["position"] == 1 and t["gap"] == pytest.approx(TOP_GAP) for t in outputs["near_ties"])
    assert result["tie_checks"] == 3  # one per prompt, asked of the baseline process
    for role in ("draft", "baseline"):
        assert result["servers"][role]["log"] == f"raw/server-{role}.log"
        assert f"fake {role} server on" in (out / "raw" / f"server-{role}.log").read_text()
    assert result["servers"]["baseline"]["kind"] == "none"
    assert "stopped the draft server" in captured.out and "stopped the baseline server" in captured.out
    from eaglenest.commands.serve.access import check_port_free

    check_port_free("127.0.0.1", port)  # nothing left listening


def test_a_started_server_that_exits_before_answering_is_one_line_naming_its_log(
    capsys, monkeypatch, prompts: Path, tokenizer_dir: Path, tmp_path: Path
):
    out, events = tmp_path / "out", tmp_path / "events.jsonl"
    monkeypatch.setattr(bench_run, "server_command", fake_serve_command(events, draft=["--fail-at-start"]))
    err = one_line_refusal(capsys, serve_args(free_port(), prompts, tokenizer_dir, out))
    log = out / "raw" / "server-draft.log"
    assert "the draft server exited with 3 before it answered" in err and f"(log: {log})" in err
    assert "RuntimeError: the fake server could not load its model" in err and log.is_file()
    assert read_events(events) == [("draft", "start")]  # the baseline never started


@pytest.mark.parametrize("how", ["refusal", "interrupt"])
def test_a_started_server_is_stopped_on_a_refusal_and_on_ctrl_c(
    capsys, monkeypatch, fast_runs, prompts: Path, tokenizer_dir: Path, tmp_path: Path, how: str
):
    out, events = tmp_path / "out", tmp_path / "events.jsonl"
    if how == "refusal":  # a draft server without spec-decode counters is refused once it answers
        monkeypatch.setattr(bench_run, "server_command", fake_serve_command(events, draft=["--plain"]))
        err = one_line_refusal(capsys, serve_args(free_port(), prompts, tokenizer_dir, out))
        assert "the draft server http://127.0.0.1:" in err and "vllm:spec_decode_* counters" in err
    else:
        monkeypatch.setattr(bench_run, "server_command", fake_serve_command(events))

        def interrupted(*args: object) -> dict:
            raise KeyboardInterrupt

        monkeypatch.setattr(sweep, "run_vllm_bench", interrupted)
        with pytest.raises(KeyboardInterrupt):
            cli.main(serve_args(free_port(), prompts, tokenizer_dir, out))
    assert read_events(events) == [("draft", "start"), ("draft", "stop")]


def test_a_started_server_killed_mid_run_ends_the_bench_in_one_line_keeping_what_was_measured(
    capsys, monkeypatch, fast_runs, prompts: Path, tokenizer_dir: Path, tmp_path: Path
):
    out, events = tmp_path / "out", tmp_path / "events.jsonl"
    # three requests per run: the draft's run at concurrency 1 completes, the process dies at its first at 2
    monkeypatch.setattr(bench_run, "server_command", fake_serve_command(events, draft=["--die-after", "3"]))
    err = one_line_refusal(
        capsys,
        serve_args(
            free_port(),
            prompts,
            tokenizer_dir,
            out,
            "--concurrency",
            "1",
            "2",
            "--num-prompts",
            "3",
            "--max-tokens",
            "3",
            "--warmup-prompts",
            "0",
            "--rounds",
            "1",
        ),
    )
    assert "the draft server http://127.0.0.1:" in err and "concurrency 2" in err and "stopped answering" in err
    assert "it exited with 1" in err and "keeps the draft's figures at concurrency [1]" in err
    assert f"server log: {out / 'raw' / 'server-draft.log'}" in err
    result = json.loads((out / "bench.json").read_text())
    assert not result["complete"] and result["stopped"] in err
    assert [(r["concurrency"], r["baseline"]) for r in result["results"]] == [(1, None)]
    assert result["results"][0]["draft"]["completed"] == 3
    assert read_events(events) == [("draft", "start")]  # died on its own; the baseline never started


@pytest.mark.parametrize(
    "flags, wanted",
    [
        (["--serve", "--url", "http://127.0.0.1:9"], "--serve with --url: --serve starts both servers here"),
        (["--url", "http://127.0.0.1:9"], "--baseline-url missing: give the draft server's --url"),
        (
            ["--url", "http://127.0.0.1:9", "--baseline-url", "http://127.0.0.1:10", "--port", "8001"],
            "--port: only with --serve",
        ),
        (
            ["--url", "http://127.0.0.1:9", "--baseline-url", "http://127.0.0.1:10", "--", "--max-model-len", "512"],
            "flags after --: only with --serve",
        ),
        (["--serve", "--tie-margin", "-1"], "--tie-margin -1: must be 0"),
        (
            [
                "--url",
                "http://127.0.0.1:9",
                "--baseline-url",
                "http://127.0.0.1:10",
                "--schedule",
                "s.json",
                "--measure-schedule",
            ],
            "--schedule, --measure-schedule: only with --serve",
        ),
    ],
)
def test_serve_flags_are_refused_in_one_line_where_they_mean_nothing(
    capsys, prompts: Path, tokenizer_dir: Path, tmp_path: Path, flags: list[str], wanted: str
):
    separator = flags.index("--") if "--" in flags else len(flags)
    argv = [
        "bench",
        *flags[:separator],
        "--prompts",
        str(prompts),
        "--tokenizer",
        str(tokenizer_dir),
        "--out",
        str(tmp_path / "o"),
        *flags[separator:],
    ]
    assert wanted in one_line_refusal(capsys, argv)


def test_serve_builds_eaglenest_serves_commands(pipeline_folders):
    verifier, draft = pipeline_folders
    setup = ServeSetup(port=8123, verifier=verifier, draft=draft, vllm_args=("--max-model-len", "512"))
    commands = {kind: server_command(setup, None, kind, cpu_build=True) for kind in (None, "none", "ngram")}
    for command in commands.values():
        assert command.argv[command.argv.index("--port") + 1] == "8123" and command.argv[-2:] == [
            "--max-model-len",
            "512",
        ]
    assert '"eagle3"' in " ".join(commands[None].argv) and "--speculative-config" not in commands["none"].argv
    assert '"ngram"' in " ".join(commands["ngram"].argv)
    with pytest.raises(EaglenestError, match=r"^--port after --: eaglenest bench --serve sets it; use --port"):
        server_command(ServeSetup(verifier=verifier, draft=draft, vllm_args=("--port=1",)), None, None, True)


# --- rounds, intervals and the K per batch size read from them -------------------------------------------------


def point(concurrency: int, low: float | None, speedup: float = 1.2, k: int = 3) -> MeasuredPoint:
    return MeasuredPoint(concurrency, k, speedup, low, None if low is None else speedup + (speedup - low), 3, pays(low))


@pytest.mark.parametrize(
    "points, max_num_seqs, wanted",
    [
        # pays at every concurrency measured: K up to the largest, 0 past it (unmeasured)
        ([point(1, 1.1), point(4, 1.05), point(16, 1.01)], 128, [(1, 16, 3), (17, 128, 0)]),
        # stops paying at 4: 2 and 3 are unmeasured, and 4 does not vouch for them
        ([point(1, 1.1), point(4, 0.7), point(16, 0.5)], 128, [(1, 1, 3), (2, 128, 0)]),
        # a tie (the interval holds 1) does not pay, nor does a figure without an interval
        ([point(1, 0.98, 1.05), point(4, 0.7)], 64, [(1, 64, 0)]),
        ([point(1, None, 1.5)], 64, [(1, 64, 0)]),
        # paying again after a concurrency that does not is noise: served plain
        ([point(1, 1.1), point(4, 0.9), point(16, 1.02)], 128, [(1, 1, 3), (2, 128, 0)]),
        # the first concurrency measured vouches for the batch sizes below it
        ([point(4, 1.1), point(16, 0.8)], 128, [(1, 4, 3), (5, 128, 0)]),
        # a server smaller than the concurrencies measured
        ([point(1, 1.1), point(4, 1.1)], 2, [(1, 2, 3)]),
        ([point(1, 1.1)], 1, [(1, 1, 3)]),
        # several Ks: the paying one with the best speed-up (ties: the smaller K), ranges of one K merged
        (
            [
                point(1, 1.1, 1.3, k=3),
                point(1, 1.2, 1.4, k=2),
                point(2, 1.05, 1.2, k=2),
                point(4, 0.9, 1.1, k=2),
                point(4, 1.01, 1.1, k=1),
                point(8, 0.9, 0.95, k=1),
            ],
            32,
            [(1, 2, 2), (3, 4, 1), (5, 32, 0)],
        ),
        ([point(1, 1.1, 1.3, k=3), point(1, 1.1, 1.3, k=2)], 8, [(1, 1, 2), (2, 8, 0)]),
    ],
)
def test_the_schedule_speculates_up_to_the_last_concurrency_that_pays_and_is_0_past_it(points, max_num_seqs, wanted):
    from eaglenest.artifacts.serve_schedule import schedule_problem

    schedule = derive_schedule(points, max_num_seqs)
    assert schedule == wanted
    assert schedule_problem([list(e) for e in schedule]) is None and schedule[-1][1] == max_num_seqs


def test_the_rows_become_measured_points_that_pay_only_above_one():
    rows = [
        {
            "concurrency": 1,
            "speedup": 1.3,
            "speedup_interval": {"low": 1.1, "high": 1.5},
            "rounds": [{"speedup": 1.2}, {"speedup": 1.4}, {"speedup": 1.3}],
        },
        {
            "concurrency": 4,
            "speedup": 1.02,
            "speedup_interval": {"low": 1.0, "high": 1.04},
            "rounds": [{"speedup": 1.0}, {"speedup": 1.04}, {"speedup": None}],
        },
        {"concurrency": 8, "speedup": 1.5, "speedup_interval": None, "rounds": [{"speedup": 1.5}]},
        {"concurrency": 16, "speedup": None, "speedup_interval": None, "rounds": []},
    ]
    assert measured_points(rows, 2) == [
        MeasuredPoint(1, 2, 1.3, 1.1, 1.5, 3, True),
        MeasuredPoint(4, 2, 1.02, 1.0, 1.04, 2, False),
        MeasuredPoint(8, 2, 1.5, None, None, 1, False),
    ]


def test_the_interval_over_rounds_is_students_t_on_the_log_speedups():
    import numpy as np

    pairs = [(20.0, 10.0), (21.0, 10.0), (19.0, 10.5)]
    interval = rounds_interval(pairs)
    logs = np.log([2.0, 2.1, 19 / 10.5])
    half = 4.303 * logs.std(ddof=1) / np.sqrt(3)
    assert interval.value == pytest.approx(np.exp(logs.mean()))
    assert (interval.low, interval.high) == pytest.approx((np.exp(logs.mean() - half), np.exp(logs.mean() + half)))
    assert interval.units == 3 and interval.low < interval.value < interval.high
    assert rounds_interval(pairs[:1]) is None and rounds_interval([]) is None
    assert rounds_interval([(10.0, 10.0), (10.0, 10.0)]).as_dict()["ci95"] == 0.0
    assert T_975[1] == 4.303 and len(T_975) == 30


def test_serve_runs_whole_rounds_one_server_at_a_time_the_pair_order_alternating():
    assert server_blocks(1) == [("draft", [0]), ("baseline", [0])]
    assert server_blocks(2) == [("baseline", [0]), ("draft", [0, 1]), ("baseline", [1])]
    assert server_blocks(3) == [("draft", [0]), ("baseline", [0, 1]), ("draft", [1, 2]), ("baseline", [2])]
    for rounds in range(1, 7):
        blocks = server_blocks(rounds)
        assert blocks[-1][0] == "baseline" and len(blocks) == rounds + 1  # ends on the baseline; R + 1 starts
        runs = [(role, n) for role, numbers in blocks for n in numbers]
        assert sorted(runs) == sorted((role, n) for role in ("draft", "baseline") for n in range(rounds))


def paced(monkeypatch: pytest.MonkeyPatch, rates: dict[tuple[str, int], list[float]]) -> list[tuple[str, int]]:
    """Runs that send the requests (fake_vllm_bench) but take the tokens/s given per (role, concurrency), round after
    round, so a sweep's speed-ups are known; returns the measured runs in the order made."""
    made: list[tuple[str, int]] = []

    def run(
        endpoint: Endpoint,
        model: str,
        dataset: Path,
        num_requests: int,
        concurrency: int,
        config: BenchConfig,
        raw_dir: Path,
        name: str,
    ) -> dict:
        raw = fake_vllm_bench(endpoint, model, dataset, num_requests, concurrency, config, raw_dir, name)
        if name.startswith("warmup"):
            return raw
        rate = rates[(endpoint.role, concurrency)][sum(m == (endpoint.role, concurrency) for m in made)]
        made.append((endpoint.role, concurrency))
        raw |= {
            "duration": raw["total_output_tokens"] / rate,
            "output_throughput": rate,
            "request_throughput": raw["completed"] * rate / raw["total_output_tokens"],
        }
        (raw_dir / f"{name}.json").write_text(json.dumps(raw))
        return raw

    monkeypatch.setattr(sweep, "run_vllm_bench", run)
    return made


RATES = {
    ("draft", 1): [20.0, 21.0, 19.0],
    ("baseline", 1): [10.0, 10.0, 10.0],  # x2: pays
    ("draft", 2): [10.0, 9.0, 11.0],
    ("baseline", 2): [10.0, 10.0, 10.0],
}  # a tie: does not


def test_rounds_give_every_concurrency_an_interval_and_the_schedule_read_from_them(
    capsys, monkeypatch, prompts: Path, tokenizer_dir: Path, tmp_path: Path
):
    """--url: three rounds, the order alternating at each concurrency; per concurrency the speed-up over the rounds
    with its interval, each side's figures pooled, every round's outputs checked; the schedule is read from the
    figures into bench.json (no record: bench does not know the draft's files)."""
    from eaglenest.core.vllm_schedule import default_max_num_seqs

    made = paced(monkeypatch, RATES)
    out = tmp_path / "out"
    with FakeServer() as draft, FakeServer(spec=False) as baseline:
        status = cli.main(
            bench_args(
                draft.url,
                baseline.url,
                prompts,
                tokenizer_dir,
                out,
                "--concurrency",
                "1",
                "2",
                "--num-prompts",
                "3",
                "--max-tokens",
                "4",
                "--warmup-prompts",
                "1",
            )
        )
    captured = capsys.readouterr()
    assert status == 0, captured.err + captured.out
    d, b = "draft", "baseline"
    assert made == [(d, 1), (b, 1), (d, 2), (b, 2), (b, 1), (d, 1), (b, 2), (d, 2), (d, 1), (b, 1), (d, 2), (b, 2)]
    result = json.loads((out / "bench.json").read_text())
    assert result["rounds"] == 3 and result["complete"]
    first, second = result["results"]
    assert first["speedup_interval"]["units"] == 3 and first["speedup_interval"]["over"] == "rounds"
    assert first["speedup"] == pytest.approx((2.0 * 2.1 * 1.9) ** (1 / 3), abs=1e-4)
    assert first["speedup_interval"]["low"] > 1 and second["speedup_interval"]["low"] < 1
    assert [r["speedup"] for r in first["rounds"]] == [2.0, 2.1, 1.9]
    assert [r["round"] for r in second["rounds"]] == [1, 2, 3]
    # pooled: all tokens over all seconds of the three runs (of equal tokens: the harmonic mean of their rates)
    assert first["draft"]["tokens_per_s"] == pytest.approx(3 / (1 / 20 + 1 / 21 + 1 / 19), abs=1e-3)
    assert (
        first["draft"]["completed"] == 9
        and first["draft"]["tau"] == 2.0
        and first["draft"]["raw"] == "raw/draft-c1-r*.json"
    )
    assert (out / "raw" / "draft-c1-r3.json").is_file() and first["outputs"]["compared"] == 9
    assert first["single_stream_speedup"]["units"] == 9
    schedule = result["schedule"]
    assert schedule["k"] == 3 and schedule["served"] is None and schedule["written"] is None
    assert schedule["derived"] == [[1, 1, 3], [2, default_max_num_seqs(1), 0]]
    assert [p["pays"] for p in schedule["measured"]] == [True, False] and "--url" in schedule["why"]
    assert f"K per batch size read from this run: K 3 at 1, 0 at 2-{default_max_num_seqs(1)}" in captured.out
    assert "geometric means of 3 paired rounds" in captured.out


def test_one_round_reads_no_schedule(capsys, monkeypatch, prompts: Path, tokenizer_dir: Path, tmp_path: Path):
    paced(monkeypatch, RATES)
    out = tmp_path / "out"
    with FakeServer() as draft, FakeServer(spec=False) as baseline:
        assert (
            cli.main(
                bench_args(
                    draft.url,
                    baseline.url,
                    prompts,
                    tokenizer_dir,
                    out,
                    "--concurrency",
                    "1",
                    "--num-prompts",
                    "3",
                    "--max-tokens",
                    "4",
                    "--rounds",
                    "1",
                )
            )
            == 0
        )
    result = json.loads((out / "bench.json").read_text())
    row = result["results"][0]
    assert row["speedup"] == 2.0 and row["speedup_interval"] is None and row["draft"]["raw"] == "raw/draft-c1.json"
    assert result["schedule"]["derived"] is None and "--rounds 3 measures one" in result["schedule"]["why"]
    assert "K per batch size: not read from this run: one round gives no interval" in capsys.readouterr().out
    assert one_line_refusal(
        capsys, bench_args("http://127.0.0.1:9", "http://127.0.0.1:10", prompts, tokenizer_dir, out, "--rounds", "0")
    ).endswith("--rounds 0: must be at least 1 (2 or more give the speed-up an interval at every concurrency)")


def scheduled_fake_command(events: Path, draft: Path, schedule: list | None = None):
    """fake_serve_command's servers, the draft's command carrying its K (3), dtype and the schedule it serves."""
    fake = fake_serve_command(events)

    def command(serve: ServeSetup, model: str | None, baseline: str | None, cpu_build: bool) -> ServeCommand:
        made = fake(serve, model, baseline, cpu_build)
        if baseline is not None:
            return made
        return ServeCommand(
            made.argv,
            made.env,
            made.k_reason,
            made.served_name,
            k=3,
            schedule=None if schedule is None else [tuple(e) for e in schedule],
            schedule_reason="" if schedule is None else "the fake's schedule",
            dtype="float32",
        )

    return command


def test_serve_writes_the_schedule_record_for_the_draft_it_measured(
    capsys, monkeypatch, prompts: Path, tokenizer_dir: Path, tmp_path: Path, pipeline_folders
):
    """--serve, two rounds: baseline | draft, draft | baseline, each server started for whole rounds; the schedule
    read from the figures is written for the draft (its fingerprint, K, host, commit), and serve then reads it."""
    from eaglenest.artifacts.serve_schedule import read_schedule_record, served_schedule

    _, draft_dir = pipeline_folders
    out, events, record = tmp_path / "out", tmp_path / "events.jsonl", tmp_path / "serve_schedule.json"
    monkeypatch.setattr(bench_run, "server_command", scheduled_fake_command(events, draft_dir))
    made = paced(
        monkeypatch,
        {
            ("draft", 1): [20.0, 21.0],
            ("baseline", 1): [10.0, 10.0],
            ("draft", 2): [15.0, 15.5],
            ("baseline", 2): [10.0, 10.0],
        },
    )
    status = cli.main(
        serve_args(
            free_port(),
            prompts,
            tokenizer_dir,
            out,
            "--concurrency",
            "1",
            "2",
            "--num-prompts",
            "3",
            "--max-tokens",
            "4",
            "--warmup-prompts",
            "0",
            "--rounds",
            "2",
            "--draft",
            str(draft_dir),
            "--schedule",
            str(record),
            "--",
            "--max-num-seqs",
            "8",
        )
    )
    captured = capsys.readouterr()
    assert status == 0, captured.err + captured.out
    assert read_events(events) == [
        ("baseline", "start"),
        ("baseline", "stop"),
        ("draft", "start"),
        ("draft", "stop"),
        ("baseline", "start"),
        ("baseline", "stop"),
    ]
    assert made == [
        ("baseline", 1),
        ("baseline", 2),
        ("draft", 1),
        ("draft", 2),
        ("draft", 1),
        ("draft", 2),
        ("baseline", 1),
        ("baseline", 2),
    ]
    result = json.loads((out / "bench.json").read_text())
    assert result["servers"]["baseline"]["starts"] == 2 and (out / "raw" / "server-baseline-2.log").is_file()
    assert all(r["speedup_interval"]["units"] == 2 for r in result["results"])
    # both concurrencies pay; 3 to 8 were not measured: 0 there
    assert result["schedule"]["written"] == str(record) and result["schedule"]["derived"] == [[1, 2, 3], [3, 8, 0]]
    written = read_schedule_record(record)
    assert written.k == 3 and written.schedule == [(1, 2, 3), (3, 8, 0)] and written.max_num_seqs == 8
    assert [(p.concurrency, p.pays) for p in written.measured] == [(1, True), (2, True)]
    document = json.loads(record.read_text())
    assert document["host"]["compute_dtype"] == "float32" and document["rounds"] == 2 and document["host"]["label"]
    assert document["draft"]["path"] == str(draft_dir) and document["bench"] == str(out / "bench.json")
    assert served_schedule(draft_dir, 3, record).schedule == [(1, 2, 3), (3, 8, 0)]
    assert f"(written to {record})" in captured.out


def test_a_served_schedule_is_checked_step_by_step_not_measured_anew(
    capsys, monkeypatch, prompts: Path, tokenizer_dir: Path, tmp_path: Path, pipeline_folders
):
    """The draft server served a schedule: no record is written, and where it gives K 0 at every batch size up to
    the concurrency, any draft counted is a step vLLM did not take as told (the fake drafts regardless)."""
    _, draft_dir = pipeline_folders
    out, events, record = tmp_path / "out", tmp_path / "events.jsonl", tmp_path / "serve_schedule.json"
    monkeypatch.setattr(bench_run, "server_command", scheduled_fake_command(events, draft_dir, [[1, 1, 3], [2, 8, 0]]))
    paced(monkeypatch, {("draft", c): [10.0, 10.0] for c in (1, 2)} | {("baseline", c): [10.0, 10.0] for c in (1, 2)})
    assert (
        cli.main(
            serve_args(
                free_port(),
                prompts,
                tokenizer_dir,
                out,
                "--concurrency",
                "1",
                "2",
                "--num-prompts",
                "3",
                "--max-tokens",
                "4",
                "--warmup-prompts",
                "0",
                "--rounds",
                "2",
                "--schedule",
                str(record),
            )
        )
        == 0
    )
    result = json.loads((out / "bench.json").read_text())
    assert result["schedule"]["served"] == [[1, 1, 3], [2, 8, 0]] and result["schedule"]["written"] is None
    assert result["servers"]["draft"]["schedule"] == [[1, 1, 3], [2, 8, 0]] and not record.exists()
    assert result["results"][0]["draft"]["counter_problems"] == []  # batch 1 drafts: expected
    monkeypatch.setattr(bench_run, "server_command", scheduled_fake_command(events, draft_dir, [[1, 8, 0]]))
    paced(monkeypatch, {("draft", 1): [10.0, 10.0], ("baseline", 1): [10.0, 10.0]})
    assert (
        cli.main(
            serve_args(
                free_port(),
                prompts,
                tokenizer_dir,
                out,
                "--concurrency",
                "1",
                "--num-prompts",
                "3",
                "--max-tokens",
                "4",
                "--warmup-prompts",
                "0",
                "--rounds",
                "2",
            )
        )
        == 0
    )
    problems = json.loads((out / "bench.json").read_text())["results"][0]["draft"]["counter_problems"]
    assert len(problems) == 2 and problems[0].startswith(
        "round 1: 6 drafts at concurrency 1, where the served schedule gives K 0 at every batch size up to 1"
    )
    assert "check: concurrency 1, draft: round 1: 6 drafts" in capsys.readouterr().out


def test_serve_builds_the_draft_server_with_the_schedule_record_or_measures_past_it(pipeline_folders, tmp_path):
    """A record of this draft at the K served is served; --measure-schedule passes over it; a broken record stops
    bench before any server starts, in one line naming it and both ways past it."""
    verifier, draft = pipeline_folders
    record = schedule_record(tmp_path / "serve_schedule.json", draft)
    setup = ServeSetup(verifier=verifier, draft=draft, schedule=record, vllm_args=("--max-num-seqs", "32"))
    command = server_command(setup, None, None, cpu_build=True)
    assert command.k == 3 and command.schedule == [(1, 4, 3), (5, 32, 0)]
    assert '"num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 32, 0]]' in command.shell()
    assert server_command(setup, None, "none", cpu_build=True).schedule is None
    measuring = server_command(
        ServeSetup(verifier=verifier, draft=draft, schedule=record, measure_schedule=True), None, None, cpu_build=True
    )
    assert measuring.schedule is None and "num_speculative_tokens_per_batch_size" not in measuring.shell()
    assert measuring.schedule_reason.endswith(f"(--measure-schedule: measured anew, written to {record})")
    record.write_text('{"draft": {"sha256": 1}}')
    with pytest.raises(EaglenestError) as err:
        server_command(setup, None, None, cpu_build=True)
    assert str(err.value).startswith(
        f"{record}: not a serve schedule record (KeyError: 'k'); `eaglenest bench "
        "--serve --measure-schedule` measures it again, and `eaglenest serve "
        "--no-schedule` serves without it"
    )


# --- API key and hostile servers ---------------------------------------------------------------------------------


def test_bench_sends_the_api_key_of_its_environment_and_never_openais(
    capsys, monkeypatch, prompts: Path, tokenizer_dir: Path, tmp_path: Path
):
    for name in ("EAGLENEST_API_KEY", "VLLM_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    # a draft server without spec-decode counters: the refusal that follows /v1/models and /metrics both answering
    with FakeServer(api_key="k3y", spec=False) as draft, FakeServer(api_key="k3y", spec=False) as baseline:
        argv = bench_args(draft.url, baseline.url, prompts, tokenizer_dir, tmp_path / "out")
        monkeypatch.setenv("OPENAI_API_KEY", "sk-for-openai")  # a key for another service stays home
        err = one_line_refusal(capsys, argv)
        assert f"--url {draft.url}: GET /v1/models answered 401" in err and "EAGLENEST_API_KEY" in err
        assert draft.authorizations == [None]
        for name in ("VLLM_API_KEY", "EAGLENEST_API_KEY"):
            monkeypatch.setenv(name, "k3y")
            err = one_line_refusal(capsys, argv)
            assert "no vllm:spec_decode_* counters" in err
        assert set(draft.authorizations[1:]) == set(baseline.authorizations) - {None} == {"Bearer k3y"}


def test_bench_records_the_servers_commands_without_the_api_key(monkeypatch, pipeline_folders, tmp_path: Path):
    verifier, draft = pipeline_folders
    setup = ServeSetup(verifier=verifier, draft=draft, vllm_args=("--hf-token", "hf_s3cret"))
    commands = {"draft": server_command(setup, None, None, cpu_build=True)}
    config = BenchConfig(None, None, tmp_path / "p.jsonl", serve=setup)
    recorded = json.dumps(bench_run._new_result(config, "vllm bench serve", ("u", "u"), None, [[1]], commands))
    assert "s3cret" not in recorded and "HF_TOKEN=***" in recorded
    with pytest.raises(EaglenestError, match="--api-key after --: .* export VLLM_API_KEY=... instead"):
        server_command(ServeSetup(verifier=verifier, draft=draft, vllm_args=("--api-key", "k")), None, None, True)


class HostileHandler(BaseHTTPRequestHandler):
    """A server that answers /v1/models with more than bench reads, /v1/completions with escape sequences in its
    status line and body, and /small with a model id full of them."""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/small/v1/models":
            data = json.dumps({"data": [{"id": "tiny\x1b[2J\x1b]0;owned\x07\rx"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_response(200)
        self.end_headers()
        with contextlib.suppress(OSError):  # bench hangs up once it has read its cap
            for _ in range(MAX_RESPONSE_BYTES // 2**20 + 2):
                self.wfile.write(b"x" * 2**20)

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        data = "bad\x1b[31m request\r\n\x1b]8;;http://x\x07link\u009b1m ".encode() + b"y" * 2 * ERROR_BODY_BYTES
        self.send_response(400, "Bad\x1b[2J Request")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def hostile_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), HostileHandler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_an_answer_larger_than_the_cap_is_refused_in_one_line(
    capsys, hostile_url: str, prompts: Path, tokenizer_dir: Path, tmp_path: Path
):
    with FakeServer(spec=False) as baseline:
        err = one_line_refusal(capsys, bench_args(hostile_url, baseline.url, prompts, tokenizer_dir, tmp_path / "o"))
    assert f"--url {hostile_url}: GET /v1/models answered more than 8 MiB" in err


def test_a_servers_strings_reach_the_terminal_and_bench_json_without_escapes(hostile_url: str):
    with pytest.raises(EaglenestError) as refused:
        Endpoint("draft", "--url", hostile_url).post("/v1/completions", {"prompt": [1]}, timeout_s=5)
    message = str(refused.value)
    assert "\x1b" not in message and "\r" not in message and "\n" not in message and "\x07" not in message
    assert "\x9b" not in message and "answered 400 Bad Request: bad request link 1m yyy" in message
    assert len(message) < 400
    models = Endpoint("draft", "--url", hostile_url + "/small").models()
    assert list(models) == ["tiny x"] and models["tiny x"]["id"] == "tiny x"


@pytest.mark.slow  # imports vLLM's bench (about 7 s)
def test_vllm_bench_serve_sends_bench_s_key_not_openais(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("EAGLENEST_API_KEY", "k3y")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-for-openai")  # vllm bench serve would send this one
    dataset = tmp_path / "requests.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": [5 + i, 6, 7]}) + "\n" for i in range(2)))
    config = BenchConfig("u", "b", tmp_path / "p.jsonl", max_tokens=3)
    with FakeServer(api_key="k3y") as server:
        raw = run_vllm_bench(Endpoint("draft", "--url", server.url), "tiny", dataset, 2, 1, config, tmp_path, "run")
    # the fake answers a completion only with the key (vLLM's bench asks /v1/models first without any header)
    assert raw["completed"] == 2 and "Bearer sk-for-openai" not in server.authorizations
