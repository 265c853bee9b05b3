"""``eaglenest serve --record DIR``: the recording middleware driven as the ASGI app it wraps (a small Starlette app
answering as vLLM's OpenAI server does), the server command it adds (fast), and the real server recording
``eaglenest replay``'s requests across a restart (slow)."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from eaglenest.artifacts.draft_hash import draft_fingerprint
from eaglenest.artifacts.traffic import traffic_files
from eaglenest.artifacts.traffic.records import TrafficRecord, read_traffic
from eaglenest.commands import cli
from eaglenest.commands.serve import record as record_module
from eaglenest.commands.serve.record import (
    MIDDLEWARE,
    RECORD_DIR_ENV,
    RECORD_DRAFT_ENV,
    RECORD_K_ENV,
    RECORD_MAX_BYTES_ENV,
    TrafficRecorder,
    read_answer,
)
from tests.commands.test_serve import answers_or_exited, free_port, no_exec  # noqa: F401 (no_exec: a fixture)
from tests.conftest import requires_vllm
from tests.fixtures.pipeline import project_env

DRAFT = "cd" * 32
PIECES = ["Hel", "lo ", "thé", "re"]
SPEC = {
    "mean_acceptance_length": 1.75,
    "draft_acceptance_rate": 0.375,
    "acceptance_histogram": [1, 2, 1],
    "num_spec_steps": 4,
    "num_accepted_draft_tokens": 3,
    "num_draft_tokens": 8,
    "num_spec_tokens": 2,
}
# What a line keeps of vLLM's summary: all but the histogram.
KEPT_SPEC = {key: value for key, value in SPEC.items() if key != "acceptance_histogram"}
USAGE = {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say hello ü"}]


def vllm_like_app() -> Starlette:
    """Answers /v1/chat/completions and /v1/completions with bodies shaped as vLLM's (a JSON object, or server-sent
    events ending in a usage chunk with the metrics, then ``[DONE]``), GET /v1/models; the ``x-status`` header picks
    an error answer."""

    async def generate(request: Request) -> Response:
        body = await request.json()
        status = int(request.headers.get("x-status", "200"))
        if status != 200:
            return JSONResponse({"error": {"message": "refused", "code": status}}, status_code=status)
        chat = request.url.path.endswith("/chat/completions")
        n = body.get("n") or 1
        if body.get("stream"):

            async def events():
                if chat:
                    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    yield f"data: {json.dumps({'id': 'c1', 'choices': [first]})}\n\n"
                yield ": keep-alive\n\n"
                for piece in PIECES:
                    choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
                    yield f"data: {json.dumps({'id': 'c1', 'choices': [{**choice, 'finish_reason': None}]})}\n\n"
                last = {"index": 0, "delta": {"content": ""}} if chat else {"index": 0, "text": ""}
                yield f"data: {json.dumps({'id': 'c1', 'choices': [{**last, 'finish_reason': 'length'}]})}\n\n"
                if (body.get("stream_options") or {}).get("include_usage"):
                    final = {"id": "c1", "choices": [], "usage": USAGE, "metrics": {"speculative_decoding": SPEC}}
                    yield f"data: {json.dumps(final)}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        text = "".join(PIECES)
        choices = [
            {"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
            if chat
            else {"index": i, "text": text, "finish_reason": "stop"}
            for i in range(n)
        ]
        answer: dict[str, Any] = {"id": "c1", "object": "chat.completion", "model": body.get("model")}
        answer |= {"choices": choices, "usage": USAGE}
        if n == 1:  # vLLM gives no per-request metrics for n > 1
            answer["metrics"] = {"time_to_first_token_ms": 3.5, "speculative_decoding": SPEC}
        return JSONResponse(answer)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "tiny/llama"}]})

    return Starlette(
        routes=[
            Route("/v1/chat/completions", generate, methods=["POST"]),
            Route("/v1/completions", generate, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
        ]
    )


@pytest.fixture
def folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The recorder's settings as ``eaglenest serve --record`` passes them: its folder, a draft and K = 2."""
    directory = tmp_path / "traffic"
    monkeypatch.setenv(RECORD_DIR_ENV, str(directory))
    monkeypatch.delenv(RECORD_MAX_BYTES_ENV, raising=False)
    monkeypatch.setenv(RECORD_DRAFT_ENV, DRAFT)
    monkeypatch.setenv(RECORD_K_ENV, "2")
    return directory


def recorded(directory: Path) -> list[TrafficRecord]:
    """The folder's lines, each checked as prepare reads it; none where nothing was written."""
    if not traffic_files(directory):
        return []
    log = read_traffic(directory, "test")
    assert log.cut_lines == 0
    return [request.record for request in log.requests]


def both(path: str, body: dict[str, Any], **kwargs: Any) -> tuple[Any, Any]:
    """The answer of the bare app and of the app with the recorder, to one request."""
    answers = []
    for app in (vllm_like_app(), TrafficRecorder(vllm_like_app())):
        with TestClient(app) as client:  # as a context: the lifespan messages pass the recorder too
            answers.append(client.post(path, json=body, **kwargs))
    return answers[0], answers[1]


def test_a_chat_answer_is_recorded_as_one_line_and_reaches_the_client_unchanged(folder: Path):
    """A 200 chat answer: the client gets the same bytes and headers as without the recorder, and one line holds the
    messages, the reply, the finish reason, the usage, vLLM's acceptance (less its histogram), the draft's
    fingerprint and K from the environment."""
    body = {"model": "tiny/llama", "messages": MESSAGES, "max_tokens": 4}
    bare, wrapped = both("/v1/chat/completions", body)
    assert wrapped.status_code == bare.status_code == 200
    assert wrapped.content == bare.content and wrapped.headers == bare.headers
    (line,) = recorded(folder)
    assert line.endpoint == "chat" and line.model == "tiny/llama" and line.messages == MESSAGES
    assert line.prompt is None and line.reply == "".join(PIECES) == "Hello thére" and line.finish_reason == "stop"
    assert line.usage == USAGE and line.acceptance is not None and line.acceptance.model_dump() == KEPT_SPEC
    assert line.draft == DRAFT and line.k == 2 and line.time.endswith("Z")


def test_a_streamed_chat_answer_is_recorded_with_its_pieces_joined(folder: Path):
    """A streamed answer (server-sent events, a keep-alive comment among them): the client gets the same events; the
    line's reply is the pieces joined, its acceptance and usage those of the final usage chunk. Without
    ``include_usage`` vLLM sends no such chunk: the line has the reply and no acceptance."""
    body = {"model": "tiny/llama", "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}}
    bare, wrapped = both("/v1/chat/completions", body)
    assert wrapped.status_code == 200 and wrapped.content == bare.content and b"data: [DONE]" in wrapped.content
    (line,) = recorded(folder)
    assert line.reply == "".join(PIECES) and line.finish_reason == "length" and line.messages == MESSAGES
    assert line.usage == USAGE and line.acceptance is not None and line.acceptance.model_dump() == KEPT_SPEC

    with TestClient(TrafficRecorder(vllm_like_app())) as client:
        answer = client.post("/v1/chat/completions", json={**body, "stream_options": None})
    assert answer.status_code == 200
    second = recorded(folder)[1]
    assert second.reply == "".join(PIECES) and second.usage is None and second.acceptance is None


def test_a_completion_is_recorded_with_its_prompt(folder: Path):
    """/v1/completions, plain and streamed: the line is a completion's, with the prompt and no messages."""
    with TestClient(TrafficRecorder(vllm_like_app())) as client:
        assert client.post("/v1/completions", json={"model": "m", "prompt": "once upon"}).status_code == 200
        streamed = {"model": "m", "prompt": [1, 2, 3], "stream": True, "stream_options": {"include_usage": True}}
        assert client.post("/v1/completions", json=streamed).status_code == 200
    plain, stream = recorded(folder)
    assert plain.endpoint == stream.endpoint == "completion" and plain.messages is None
    assert plain.prompt == "once upon" and stream.prompt == [1, 2, 3]
    assert plain.reply == stream.reply == "".join(PIECES) and stream.acceptance is not None


@pytest.mark.parametrize("status", [401, 500])
def test_an_error_answer_is_not_recorded_and_reaches_the_client_unchanged(folder: Path, status: int):
    """An answer other than 200 (unauthenticated, failed) is passed through as it is and leaves no line."""
    body = {"model": "tiny/llama", "messages": MESSAGES}
    bare, wrapped = both("/v1/chat/completions", body, headers={"x-status": str(status)})
    assert wrapped.status_code == bare.status_code == status and wrapped.content == bare.content
    assert recorded(folder) == []


def test_a_request_for_several_choices_is_not_recorded(folder: Path):
    """``n`` = 2 (vLLM gives no per-request acceptance for it): answered unchanged, not recorded; ``n`` = 1 is."""
    body = {"model": "tiny/llama", "messages": MESSAGES, "n": 2}
    bare, wrapped = both("/v1/chat/completions", body)
    assert wrapped.status_code == 200 and wrapped.content == bare.content
    assert len(wrapped.json()["choices"]) == 2 and recorded(folder) == []
    with TestClient(TrafficRecorder(vllm_like_app())) as client:
        assert client.post("/v1/chat/completions", json={**body, "n": 1}).status_code == 200
    assert len(recorded(folder)) == 1


def test_other_paths_pass_through_untouched(folder: Path):
    """GET /v1/models (and a GET of a recorded path, refused by the app) go through as they are, and leave no
    line."""
    with TestClient(vllm_like_app()) as client:
        bare = client.get("/v1/models")
    with TestClient(TrafficRecorder(vllm_like_app())) as client:
        wrapped = client.get("/v1/models")
        assert client.get("/v1/chat/completions").status_code == 405
    assert wrapped.status_code == 200 and wrapped.content == bare.content and wrapped.headers == bare.headers
    assert recorded(folder) == []


def test_an_oversized_body_or_a_failed_write_is_served_and_not_recorded(
    folder: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    """A request past the size limit is answered unchanged and not recorded; a write that fails (a full disk) is
    logged, and the client still gets its whole answer."""
    monkeypatch.setattr(record_module, "MAX_BODY_BYTES", 64)
    body = {"model": "tiny/llama", "messages": MESSAGES}
    bare, wrapped = both("/v1/chat/completions", body)
    assert wrapped.status_code == 200 and wrapped.content == bare.content and recorded(folder) == []
    assert "not recorded" in caplog.text
    monkeypatch.undo()
    monkeypatch.setenv(RECORD_DIR_ENV, str(folder))
    recorder = TrafficRecorder(vllm_like_app())

    def full_disk(record: dict) -> Path:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(recorder.writer, "append", full_disk)
    with TestClient(recorder) as client:
        answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200 and answer.content == bare.content
    assert "could not append" in caplog.text and "No space left on device" in caplog.text


def test_the_recorder_refuses_to_start_without_its_folder(monkeypatch: pytest.MonkeyPatch):
    """Loaded by vLLM without ``eaglenest serve --record`` (no folder in the environment), it fails at start."""
    monkeypatch.delenv(RECORD_DIR_ENV, raising=False)
    with pytest.raises(RuntimeError, match=RECORD_DIR_ENV):
        TrafficRecorder(vllm_like_app())


def test_read_answer_takes_the_first_choice_and_passes_over_what_is_not_json():
    """``read_answer``: choice 0 only, a body that is not JSON gives an empty reply, an event that is not JSON is
    passed over."""
    two = {"choices": [{"index": 1, "message": {"content": "no"}}, {"index": 0, "message": {"content": "yes"}}]}
    assert read_answer(json.dumps(two).encode(), streamed=False, endpoint="chat")["reply"] == "yes"
    assert read_answer(b"<html>", streamed=False, endpoint="chat") == {
        "reply": "",
        "finish_reason": None,
        "usage": None,
        "acceptance": None,
    }
    events = b'data: {"choices":[{"index":0,"text":"a"}]}\r\n\r\ndata: {broken\n\ndata: [DONE]\n\n'
    assert read_answer(events, streamed=True, endpoint="completion")["reply"] == "a"


# --- the server command (fast) ---------------------------------------------------------------------------
def print_command(capsys, verifier: Path, draft: Path, *flags: str) -> tuple[int, list[str], dict[str, str], str]:
    """``eaglenest serve`` with ``flags`` (those after ``--`` last) and ``--print-command``: status, argv, env,
    stderr."""
    own, separator, vllm = list(flags), [], []
    if "--" in flags:
        cut = flags.index("--")
        own, separator, vllm = list(flags[:cut]), ["--"], list(flags[cut + 1 :])
    base = ["serve", "--verifier", str(verifier), "--draft", str(draft), "--port", str(free_port())]
    status = cli.main([*base, *own, "--print-command", *separator, *vllm])
    captured = capsys.readouterr()
    if status != 0:
        return status, [], {}, captured.err
    words = shlex.split(captured.out.strip())
    start = next(i for i, word in enumerate(words) if "=" not in word)
    return status, words[start:], dict(word.split("=", 1) for word in words[:start]), captured.err


RECORD_ENV = (RECORD_DIR_ENV, RECORD_MAX_BYTES_ENV, RECORD_DRAFT_ENV, RECORD_K_ENV)


def test_record_adds_the_middleware_the_per_request_acceptance_and_its_environment(
    capsys, no_exec, pipeline_folders, tmp_path: Path
):
    """``--record DIR`` on the draft: the command loads the middleware and asks vLLM for per-request acceptance
    (``summary``), the environment names the folder (absolute), the size limit (``--record-max-mb``), the draft's
    fingerprint and the K served; stderr says RECORDING and where. Without ``--record``: none of it."""
    verifier, draft = pipeline_folders
    status, argv, env, err = print_command(
        capsys, verifier, draft, "--record", "traffic", "--record-max-mb", "0.5", "--", "--max-model-len", "256"
    )
    assert status == 0 and no_exec == []
    assert argv[argv.index("--middleware") + 1] == MIDDLEWARE == "eaglenest.commands.serve.record.TrafficRecorder"
    assert argv[argv.index("--per-request-spec-decode-metrics") + 1] == "summary"
    assert argv.count("--middleware") == argv.count("--per-request-spec-decode-metrics") == 1
    assert env[RECORD_DIR_ENV] == str(Path("traffic").resolve()) and env[RECORD_MAX_BYTES_ENV] == str(2**19)
    assert env[RECORD_DRAFT_ENV] == draft_fingerprint(draft) and env[RECORD_K_ENV] == "3"
    (recording,) = [line for line in err.splitlines() if "RECORDING" in line]
    assert recording.startswith("eaglenest serve: RECORDING: ") and "traffic/" in recording

    status, argv, env, err = print_command(capsys, verifier, draft)
    assert status == 0 and "--middleware" not in argv and "--per-request-spec-decode-metrics" not in argv
    assert not set(RECORD_ENV) & set(env) and "RECORDING" not in err


def test_record_reaches_the_server_it_starts(capsys, no_exec, pipeline_folders, tmp_path: Path):
    """Without ``--print-command`` the server is started with the middleware and the recorder's environment."""
    verifier, draft = pipeline_folders
    base = ["serve", "--verifier", str(verifier), "--draft", str(draft), "--port", str(free_port())]
    assert cli.main([*base, "--record", str(tmp_path / "t")]) == 0
    ((argv, env),) = no_exec
    assert MIDDLEWARE in argv and env[RECORD_DIR_ENV] == str(tmp_path / "t") and env[RECORD_K_ENV] == "3"
    assert "RECORDING" in capsys.readouterr().err


def test_record_on_a_baseline_asks_no_acceptance_of_a_server_that_does_not_draft(
    capsys, no_exec, pipeline_folders, tmp_path: Path
):
    """``--baseline none --record``: the middleware, but no per-request acceptance flag (vLLM refuses it without
    drafting) and neither draft nor K in the environment; ``--baseline ngram``: the flag and n-gram's K, no draft
    fingerprint (the acceptance is not the draft's)."""
    verifier, draft = pipeline_folders
    status, argv, env, _ = print_command(capsys, verifier, draft, "--baseline", "none", "--record", "t")
    assert status == 0 and MIDDLEWARE in argv and "--per-request-spec-decode-metrics" not in argv
    assert RECORD_DIR_ENV in env and RECORD_DRAFT_ENV not in env and RECORD_K_ENV not in env
    status, argv, env, _ = print_command(
        capsys, verifier, draft, "--baseline", "ngram", "--free-sweep", str(tmp_path / "absent.json"), "--record", "t"
    )
    assert status == 0 and argv[argv.index("--per-request-spec-decode-metrics") + 1] == "summary"
    assert RECORD_DRAFT_ENV not in env and env[RECORD_K_ENV] == "3"


@pytest.mark.parametrize(
    "flags", [["--per-request-spec-decode-metrics", "detailed"], ["--per-request-spec-decode-metrics=detailed"]]
)
def test_a_per_request_level_after_the_separator_is_kept_not_doubled(
    capsys, no_exec, pipeline_folders, flags: list[str]
):
    """``--per-request-spec-decode-metrics detailed`` after ``--`` (either spelling) is the user's choice: kept as
    given, and no second ``summary`` added."""
    verifier, draft = pipeline_folders
    status, argv, _, _ = print_command(capsys, verifier, draft, "--record", "t", "--", *flags)
    at = argv.index(flags[0])
    assert status == 0 and argv[at : at + len(flags)] == flags
    assert sum(arg.startswith("--per-request-spec-decode-metrics") for arg in argv) == 1 and "summary" not in argv


def test_a_size_limit_of_nothing_is_refused(capsys, no_exec, pipeline_folders):
    """``--record-max-mb 0`` is refused in one line before anything starts."""
    verifier, draft = pipeline_folders
    status, _, _, err = print_command(capsys, verifier, draft, "--record", "t", "--record-max-mb", "0")
    assert status == 2 and no_exec == [] and "--record-max-mb" in err and err.strip().count("\n") == 0


# --- the real server (slow) ------------------------------------------------------------------------------
REPLAYED = 48
AFTER_RESTART = 16


def prompts_file(path: Path, label: str, count: int) -> list[str]:
    """A replay file of ``count`` distinct prompts; returns them."""
    prompts = [f"{label} number {i}: tell me about the sea" for i in range(count)]
    path.write_text("".join(json.dumps({"prompt": prompt}) + "\n" for prompt in prompts))
    return prompts


@pytest.mark.slow
@requires_vllm
def test_the_real_server_records_every_replayed_request_across_a_restart(tmp_path: Path):
    """The real vLLM server, started by ``eaglenest serve --record DIR`` on a tiny random verifier and EAGLE-3 draft
    (K = 2), records each of 48 requests ``eaglenest replay`` sends 16 at a time exactly once, with the draft's
    acceptance; stopped (SIGTERM) and started again on the same folder, it adds 16 more lines and leaves the first
    48 as they were."""
    from tests.commands.test_supervised import descendants, wait_for
    from tests.core.test_measure_agreement import tiny_verifier_and_draft

    timings: dict[str, float] = {}
    started = time.monotonic()
    verifier, draft = tiny_verifier_and_draft(tmp_path / "models")
    folder = tmp_path / "traffic"
    first = prompts_file(tmp_path / "first.jsonl", "first", REPLAYED)
    second = prompts_file(tmp_path / "second.jsonl", "second", AFTER_RESTART)
    timings["build"] = time.monotonic() - started
    servers: list[subprocess.Popen] = []

    def start(label: str) -> tuple[subprocess.Popen, int]:
        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "eaglenest", "serve", "--verifier", str(verifier), "--draft", str(draft)]
            + ["--dtype", "float32", "--port", str(port), "--record", str(folder), "--", "--max-model-len", "256"],
            cwd=tmp_path,
            env=project_env(VLLM_CPU_KVCACHE_SPACE="1"),
            stdout=subprocess.DEVNULL,
            stderr=(tmp_path / f"serve-{label}.log").open("wb"),
        )
        servers.append(server)

        begun = time.monotonic()
        assert wait_for(lambda: answers_or_exited(server, port), timeout_s=300) and server.poll() is None, (
            tmp_path / f"serve-{label}.log"
        ).read_text()[-3000:]
        timings[f"start {label}"] = time.monotonic() - begun
        return server, port

    def replay(source: Path, port: int, label: str) -> dict:
        begun = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "eaglenest", "replay", str(source), "--url", f"http://127.0.0.1:{port}"]
            + ["--concurrency", "16", "--max-tokens", "8"],
            env=project_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        timings[f"replay {label}"] = time.monotonic() - begun
        assert done.returncode == 0, done.stderr[-3000:]
        summary = json.loads(done.stdout.strip().splitlines()[-1])
        assert summary["failed"] == 0 and summary["answered"] == summary["requests"], summary
        return summary

    def lines_once(count: int) -> list[TrafficRecord]:
        # the line is written just after the answer's last byte: wait for it, then make sure no more come
        assert wait_for(lambda: len(recorded(folder)) >= count, timeout_s=10), len(recorded(folder))
        time.sleep(0.5)
        return recorded(folder)

    def stop(server: subprocess.Popen) -> None:
        begun = time.monotonic()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        timings["stop"] = time.monotonic() - begun

    try:
        server, port = start("first")
        summary = replay(tmp_path / "first.jsonl", port, "48")
        lines = lines_once(REPLAYED)
        assert len(lines) == REPLAYED
        assert sorted(line.messages[0]["content"] for line in lines) == sorted(first)  # type: ignore[index]
        fingerprint = draft_fingerprint(draft)
        for line in lines:
            assert line.endpoint == "chat" and line.draft == fingerprint and line.k == 2, line
            assert line.messages == [{"role": "user", "content": line.messages[0]["content"]}]  # type: ignore[index]
            assert line.usage is not None and 1 <= line.usage["completion_tokens"] <= 8
            assert line.acceptance is not None and line.acceptance.num_spec_tokens == 2
            assert line.acceptance.num_spec_steps >= 1 and 1.0 <= line.acceptance.mean_acceptance_length <= 3.0
        assert summary["mean_acceptance_length"] is not None
        first_lines = lines
        before = {path.name: path.read_bytes() for path in traffic_files(folder)}
        stop(server)
        assert server.returncode == 128 + signal.SIGTERM or server.returncode == 0, server.returncode

        server, port = start("again")
        replay(tmp_path / "second.jsonl", port, "16")
        lines = lines_once(REPLAYED + AFTER_RESTART)
        assert len(lines) == REPLAYED + AFTER_RESTART
        contents = sorted(line.messages[0]["content"] for line in lines)  # type: ignore[index]
        assert contents == sorted(first + second)
        for name, old in before.items():  # the old lines kept as they were; new ones only ever after them
            assert (folder / name).read_bytes().startswith(old), name
        assert lines[:REPLAYED] == first_lines
        stop(server)
    finally:  # whatever failed, nothing of the servers outlives the test
        for server in servers:
            leftovers = descendants(server.pid)
            server.kill()
            server.wait()
            for pid in leftovers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
    timings["total"] = time.monotonic() - started
    print("record across a restart:", {key: round(value, 1) for key, value in timings.items()})
