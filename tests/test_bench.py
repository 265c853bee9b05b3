"""`eaglenest bench` against fake OpenAI-compatible servers on 127.0.0.1 (no vLLM engine starts): the /metrics
arithmetic, the refusals (one line, exit 2) and, slow, whole sweeps run by `vllm bench serve` itself."""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from eaglenest.commands import bench, cli
from eaglenest.core.errors import EaglenestError

from .conftest import build_tiny_tokenizer

K = 3  # the fake draft's speculative tokens: it accepts the first of each draft, so tau is exactly 2


class FakeServer:
    """A vLLM-like OpenAI server: /v1/models, streamed /v1/completions of token-id prompts (the text a function of
    the prompt, so two servers agree), and /metrics as vLLM 0.32 names its counters, kept consistent with the
    responses.

    Args:
        model: The model id /v1/models lists.
        spec: Expose the spec-decode counters (a draft server); False: a plain server.
        token_delay: Seconds per generated token (the fake's decode speed).
        die_after: Stop listening on the completion request after this many (a server killed mid-run).
    """

    def __init__(self, model: str = "tiny", spec: bool = True, token_delay: float = 0.0,
                 die_after: int | None = None) -> None:
        from prometheus_client import CollectorRegistry, Counter

        self.model, self.spec, self.token_delay, self.die_after = model, spec, token_delay, die_after
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.generation = Counter("vllm:generation_tokens", "Generation tokens.", labels, registry=self.registry)
        self.success = Counter("vllm:request_success", "Finished requests.", labels + ["finished_reason"],
                               registry=self.registry)
        if spec:
            self.drafts = Counter("vllm:spec_decode_num_drafts", "Drafts.", labels, registry=self.registry)
            self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens.", labels,
                                        registry=self.registry)
            self.accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Accepted.", labels,
                                    registry=self.registry)
            self.per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted per position.",
                                   labels + ["position"], registry=self.registry)
            for position in range(K):  # vLLM creates every position's series at start
                self.per_pos.labels(model, "0", str(position))
            self.drafts.labels(model, "0")
            self.draft_tokens.labels(model, "0")
            self.accepted.labels(model, "0")
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def kill(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def metrics_text(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def complete(self, prompt: list[int], max_tokens: int) -> list[str]:
        """The pieces of text generated, and the counters of having generated them."""
        pieces = [f" w{(sum(prompt) + 7 * j) % 50}" for j in range(max_tokens)]
        with self.lock:
            self.generation.labels(self.model, "0").inc(max_tokens)
            self.success.labels(self.model, "0", "length").inc()
            if self.spec:
                steps = math.ceil((max_tokens - 1) / 2)  # after the prefill's token, 2 per verify step
                self.drafts.labels(self.model, "0").inc(steps)
                self.draft_tokens.labels(self.model, "0").inc(K * steps)
                self.accepted.labels(self.model, "0").inc(steps)
                self.per_pos.labels(self.model, "0", "0").inc(steps)
        return pieces

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _json(self, body: dict, status: int = 200) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/v1/models":
                    self._json({"object": "list", "data": [{"id": fake.model, "object": "model", "root": fake.model,
                                                            "max_model_len": 2048}]})
                elif self.path == "/metrics":
                    data = fake.metrics_text().encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain; version=0.0.4")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                else:
                    self._json({"error": "not found"}, 404)

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/completions" or body.get("model") != fake.model:
                    self._json({"error": f"no {self.path} for {body.get('model')}"}, 404)
                    return
                with fake.lock:
                    fake.requests.append(body)
                    number = len(fake.requests)
                if fake.die_after is not None and number > fake.die_after:
                    threading.Thread(target=fake.kill, daemon=True).start()
                    self.close_connection = True
                    return
                prompt = body["prompt"]
                assert isinstance(prompt, list) and all(isinstance(t, int) for t in prompt), prompt
                pieces = fake.complete(prompt, int(body["max_tokens"]))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()  # HTTP/1.0: the stream ends when the connection closes

                def event(payload: dict | str) -> None:
                    text = payload if isinstance(payload, str) else json.dumps(payload)
                    self.wfile.write(f"data: {text}\n\n".encode())
                    self.wfile.flush()

                for piece in pieces:
                    time.sleep(fake.token_delay)
                    event({"object": "text_completion", "model": fake.model,
                           "choices": [{"index": 0, "text": piece, "finish_reason": None}]})
                event({"object": "text_completion", "model": fake.model, "choices": [],
                       "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(pieces),
                                 "total_tokens": len(prompt) + len(pieces)}})
                event("[DONE]")

        return Handler


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    build_tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    records = [{"prompt": "hello there how are you today"},
               {"messages": [{"role": "user", "content": "what is the capital of France?"}]},
               {"question_id": 81, "category": "writing", "turns": ["the weather is nice", "and tomorrow?"]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_args(draft: str, baseline: str, prompts: Path, tokenizer: Path, out: Path, *extra: str) -> list[str]:
    return ["bench", "--url", draft, "--baseline-url", baseline, "--prompts", str(prompts), "--tokenizer",
            str(tokenizer), "--out", str(out), *extra]


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
    counters = bench.parse_metrics(VLLM_METRICS, "test")
    assert counters.has_spec_decode
    assert counters.totals[bench.DRAFTS] == 10.0  # both engines; the _created timestamp is not a count
    assert counters.totals[bench.ACCEPTED] == 19.0 and counters.totals[bench.GENERATION_TOKENS] == 40.0
    assert counters.accepted_per_pos == {0: 9.0, 1: 6.0, 2: 4.0}
    assert "vllm:num_requests_running" not in counters.totals  # a gauge
    plain = bench.parse_metrics(VLLM_METRICS.split("# HELP vllm:generation")[0].replace("spec_decode", "other"), "t")
    assert not plain.has_spec_decode


def test_tau_is_one_plus_accepted_over_drafts_between_two_readings():
    before = bench.parse_metrics(VLLM_METRICS, "before")
    after = bench.Counters(
        {**before.totals, bench.DRAFTS: 10.0 + 4, bench.DRAFT_TOKENS: 30.0 + 12, bench.ACCEPTED: 19.0 + 6},
        {0: 9.0 + 3, 1: 6.0 + 2, 2: 4.0 + 1})
    spec = bench.acceptance(before, after)
    assert spec == {"drafts": 4, "draft_tokens": 12, "accepted_tokens": 6, "accepted_per_position": [3, 2, 1],
                    "tau": 2.5, "per_position_acceptance": [0.75, 0.5, 0.25]}
    raw = {"spec_decode_acceptance_length": 2.5, "total_output_tokens": 0, "completed": 0}
    assert bench.counter_problems(before, after, spec, raw, spec_expected=True) == []
    # vLLM's own figure from the same counters disagreeing, or tokens the responses do not hold, are reported
    raw = {"spec_decode_acceptance_length": 2.4, "total_output_tokens": 5, "completed": 0}
    problems = bench.counter_problems(before, after, spec, raw, spec_expected=True)
    assert len(problems) == 2 and "vLLM's bench read 2.4" in problems[1] and "grew by 0" in problems[0]
    assert bench.acceptance(bench.Counters({}, {}), bench.Counters({}, {})) is None
    # per-position counts that do not add up, or that rise with the position, are reported too
    odd = bench.Counters(after.totals, {0: 9.0 + 1, 1: 6.0 + 3, 2: 4.0 + 1})
    problems = bench.counter_problems(before, odd, bench.acceptance(before, odd),
                                      {"spec_decode_acceptance_length": 2.5, "total_output_tokens": 0,
                                       "completed": 0}, spec_expected=True)
    assert problems == ["the accepted tokens per position sum to 5, not 6",
                        "accepted tokens per position rise with the position: [1, 3, 1]"]


@pytest.mark.parametrize("flags, wanted", [
    (["--concurrency", "0", "2"], "--concurrency 0 2: every value must be at least 1"),
    (["--concurrency", "1", "8", "--num-prompts", "4"], "--num-prompts 4: below --concurrency 8"),
    (["--max-tokens", "0"], "--max-tokens 0: must be at least 1"),
])
def test_flags_that_cannot_make_a_sweep_are_refused(capsys, prompts: Path, tokenizer_dir: Path, tmp_path: Path,
                                                    flags: list[str], wanted: str):
    err = one_line_refusal(capsys, bench_args("http://127.0.0.1:9", "http://127.0.0.1:10", prompts, tokenizer_dir,
                                              tmp_path / "o", *flags))
    assert wanted in err


def test_fake_server_metrics_parse_as_vllms():
    with FakeServer() as fake:
        fake.complete([1, 2, 3], 5)
        counters = bench.Endpoint("draft", "--url", fake.url).counters()
    assert counters.totals[bench.DRAFTS] == 2 and counters.totals[bench.ACCEPTED] == 2
    assert counters.accepted_per_pos == {0: 2.0, 1: 0.0, 2: 0.0}


def test_speedup_stops_paying_at_the_lowest_concurrency_below_one():
    rows = [{"concurrency": 1, "speedup": 1.4}, {"concurrency": 4, "speedup": 0.97}, {"concurrency": 8,
                                                                                      "speedup": 1.01},
            {"concurrency": 16, "speedup": 0.8}]
    assert bench.stops_paying_at(rows) == 4
    assert bench.stops_paying_at(rows[:1]) is None


def test_outputs_are_compared_request_by_request_skipping_failures():
    draft = {"generated_texts": ["a", "b", "c", "d"], "errors": ["", "", "", "boom"]}
    baseline = {"generated_texts": ["a", "x", "c", "d"], "errors": ["", "", "", ""]}
    assert bench.compare_outputs(draft, baseline, ["p0", "p1", "p2"]) == {
        "compared": 3, "identical": 2, "differ": [{"request": 1, "prompt": "p1"}]}


def test_urls_are_reduced_to_the_server_root():
    assert bench.base_url("http://127.0.0.1:8000/v1/", "--url") == "http://127.0.0.1:8000"
    assert bench.base_url("http://host:1/prefix/v1", "--url") == "http://host:1/prefix"
    with pytest.raises(EaglenestError, match="--url localhost:8000"):
        bench.base_url("localhost:8000", "--url")


# --- refusals: one line, exit 2 ---------------------------------------------------------------------------------

def test_an_unreachable_url_is_refused(capsys, prompts: Path, tokenizer_dir: Path, tmp_path: Path):
    with FakeServer(spec=False) as baseline:
        err = one_line_refusal(capsys, bench_args(f"http://127.0.0.1:{free_port()}", baseline.url, prompts,
                                                  tokenizer_dir, tmp_path / "out"))
    assert "--url http://127.0.0.1:" in err and "no server answers" in err


def test_a_server_of_another_model_is_refused(capsys, prompts: Path, tokenizer_dir: Path, tmp_path: Path):
    with FakeServer(model="tiny") as draft, FakeServer(model="other", spec=False) as baseline:
        err = one_line_refusal(capsys, bench_args(draft.url, baseline.url, prompts, tokenizer_dir, tmp_path / "o"))
        assert "--baseline-url" in err and "'other'" in err and "same model" in err
        err = one_line_refusal(capsys, bench_args(draft.url, baseline.url, prompts, tokenizer_dir, tmp_path / "o",
                                                  "--model", "llama"))
        assert f"--url {draft.url} serves ['tiny'], not 'llama'" in err
    assert draft.requests == [] and baseline.requests == []


def test_a_draft_server_without_spec_decode_counters_is_refused(capsys, prompts: Path, tokenizer_dir: Path,
                                                                 tmp_path: Path):
    with FakeServer(spec=False) as draft, FakeServer(spec=False) as baseline:
        err = one_line_refusal(capsys, bench_args(draft.url, baseline.url, prompts, tokenizer_dir, tmp_path / "o"))
    assert "vllm:spec_decode_* counters" in err and "--url" in err


@pytest.mark.parametrize("content, wanted", [
    ('{"text": "no known field"}\n', "line 1: expected"),
    ('{"prompt": "fine"}\nnot json\n', "line 2: not valid JSON"),
    ("", "no prompts"),
])
def test_a_prompts_file_in_none_of_the_formats_is_refused(capsys, tmp_path: Path, tokenizer_dir: Path,
                                                          content: str, wanted: str):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    err = one_line_refusal(capsys, bench_args("http://127.0.0.1:9", "http://127.0.0.1:10", path, tokenizer_dir,
                                              tmp_path / "o"))
    assert "--prompts" in err and str(path) in err and wanted in err


def test_the_same_server_twice_is_refused(capsys, prompts: Path, tokenizer_dir: Path, tmp_path: Path):
    err = one_line_refusal(capsys, bench_args("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000", prompts,
                                              tokenizer_dir, tmp_path / "o"))
    assert "both http://127.0.0.1:8000" in err


# --- whole sweeps, with vLLM's bench (each run starts a Python that imports vLLM: slow on 2 cores) -------------

@pytest.mark.slow
def test_a_sweep_writes_bench_json_and_the_plot(capsys, prompts: Path, tokenizer_dir: Path, tmp_path: Path):
    out = tmp_path / "out"
    with FakeServer(token_delay=0.002) as draft, FakeServer(spec=False, token_delay=0.004) as baseline:
        status = cli.main(bench_args(draft.url, baseline.url, prompts, tokenizer_dir, out, "--concurrency", "1",
                                     "2", "--num-prompts", "4", "--max-tokens", "5", "--warmup-prompts", "1"))
        captured = capsys.readouterr()
        assert status == 0, captured.err + captured.out
        # the token ids sent are the chat-templated first turns, request i being prompt i mod 3, on both servers
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        first = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": "hello there how are you today"}],
                                                        tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)["input_ids"]
        assert draft.requests[0]["prompt"] == first  # the warm-up's
        measured = draft.requests[1:]
        theirs = baseline.requests[1:]
        assert len(measured) == 8 and [r["prompt"] for r in measured[:4]] == [r["prompt"] for r in theirs[:4]]
        assert sorted(r["prompt"] for r in measured) == sorted(r["prompt"] for r in theirs)  # c2: in any order
        assert measured[3]["prompt"] == first and all(r["max_tokens"] == 5 and r["temperature"] == 0
                                                      for r in measured)
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
        assert row["outputs"] == {"compared": 4, "identical": 4, "differ": []}
        assert (out / row["draft"]["raw"]).is_file()
    assert result["stops_paying_at"] == bench.stops_paying_at(result["results"])
    assert (out / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "speed-up" in captured.out and "wrote" in captured.out


@pytest.mark.slow
def test_a_server_killed_mid_run_ends_the_bench_in_one_line_keeping_what_was_measured(
        capsys, prompts: Path, tokenizer_dir: Path, tmp_path: Path):
    out = tmp_path / "out"
    # three requests per run: concurrency 1 completes on both, the draft dies at its first request at 2
    with FakeServer(die_after=3) as draft, FakeServer(spec=False) as baseline:
        status = cli.main(bench_args(draft.url, baseline.url, prompts, tokenizer_dir, out, "--concurrency", "1",
                                     "2", "--num-prompts", "3", "--max-tokens", "3", "--warmup-prompts", "0"))
    err = capsys.readouterr().err.strip()
    assert status == 2 and err.count("\n") == 0, err
    assert f"--url {draft.url}" in err and "concurrency 2" in err and "stopped answering" in err
    assert "keeps concurrency [1]" in err
    result = json.loads((out / "bench.json").read_text())
    assert not result["complete"] and [r["concurrency"] for r in result["results"]] == [1]
    assert result["stopped"] in err and (out / "speedup.png").is_file()
