"""``eaglenest serve --record DIR``: every answered chat and completion request kept as one line of served traffic.

A pure ASGI middleware that vLLM's own OpenAI server loads (``--middleware``, vLLM's hook for it), inside the API
server process: no second server, no extra hop. It copies the request body as the server reads it and the response
body as the server sends it, and once the last byte of an answer has gone to the client it appends one line
(:mod:`eaglenest.artifacts.traffic`) with the messages, the reply and vLLM's per-request acceptance (the response's
``metrics.speculative_decoding``, which ``--per-request-spec-decode-metrics summary`` turns on). The client never
waits for the write. Streamed answers are read from their server-sent events; their acceptance rides on the final
usage chunk, which vLLM sends where the client asks for usage (``stream_options.include_usage``).

Not recorded, by design: answers other than 200 (refused, unauthenticated, failed), requests with ``n`` > 1 (vLLM
gives no per-request acceptance for them), and bodies past ``MAX_BODY_BYTES`` (each such request is logged). A
write that fails (a full disk) is logged and the server goes on answering.

The settings come from the environment ``eaglenest serve`` starts vLLM with (vLLM builds the middleware with no
arguments): ``RECORD_DIR_ENV`` (the folder), ``RECORD_MAX_BYTES_ENV``, ``RECORD_DRAFT_ENV`` and ``RECORD_K_ENV``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from eaglenest.artifacts.traffic import ACCEPTANCE_FIELDS, RECORD_VERSION, TrafficWriter, utc_now

log = logging.getLogger("eaglenest.serve.record")

RECORD_DIR_ENV = "EAGLENEST_RECORD_DIR"
RECORD_MAX_BYTES_ENV = "EAGLENEST_RECORD_MAX_BYTES"
RECORD_DRAFT_ENV = "EAGLENEST_RECORD_DRAFT"
RECORD_K_ENV = "EAGLENEST_RECORD_K"
# The import path vLLM's --middleware is given.
MIDDLEWARE = f"{__name__}.TrafficRecorder"
# The paths recorded, and what a line calls them.
RECORDED_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
# A request or answer body past this is served but not recorded: a line is read whole by prepare.
MAX_BODY_BYTES = 16 * 2**20

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class TrafficRecorder:
    """The recording middleware (vLLM adds it with ``app.add_middleware(TrafficRecorder)``).

    Raises:
        RuntimeError: at server start, where ``RECORD_DIR_ENV`` is unset (it was loaded without ``eaglenest serve
            --record``) or a setting is not a number.
    """

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app
        directory = os.environ.get(RECORD_DIR_ENV)
        if not directory:
            raise RuntimeError(
                f"{MIDDLEWARE}: {RECORD_DIR_ENV} names no folder; start it with `eaglenest serve --record`"
            )
        max_bytes = os.environ.get(RECORD_MAX_BYTES_ENV)
        k = os.environ.get(RECORD_K_ENV)
        self.writer = TrafficWriter(Path(directory), int(max_bytes)) if max_bytes else TrafficWriter(Path(directory))
        self.draft = os.environ.get(RECORD_DRAFT_ENV) or None
        self.k = int(k) if k else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = RECORDED_PATHS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if endpoint is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        request = bytearray()
        answer = bytearray()
        status: list[int] = []
        oversized: list[bool] = []

        async def receive_copy() -> Message:
            message = await receive()
            if message["type"] == "http.request" and not oversized:
                request.extend(message.get("body", b""))
                if len(request) > MAX_BODY_BYTES:
                    oversized.append(True)
            return message

        async def send_copy(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            elif message["type"] == "http.response.body" and not oversized:
                answer.extend(message.get("body", b""))
                if len(answer) > MAX_BODY_BYTES:
                    oversized.append(True)
            await send(message)
            # After the answer's last byte has gone: the client does not wait for the line.
            finished = message["type"] == "http.response.body" and not message.get("more_body", False)
            if finished and status == [200]:
                self._record(endpoint, bytes(request), bytes(answer), bool(oversized))

        await self.app(scope, receive_copy, send_copy)

    def _record(self, endpoint: str, request_body: bytes, answer_body: bytes, oversized: bool) -> None:
        if oversized:
            log.warning("eaglenest serve --record: a request or answer past %d MiB, not recorded", MAX_BODY_BYTES >> 20)
            return
        try:
            request = json.loads(request_body)
        except ValueError:
            return  # vLLM answered 200 to a body that is not JSON: nothing a line could hold
        if not isinstance(request, dict) or request.get("n", 1) not in (1, None):
            return
        reply = read_answer(answer_body, streamed=bool(request.get("stream")), endpoint=endpoint)
        record = {
            "version": RECORD_VERSION,
            "time": utc_now(),
            "endpoint": endpoint,
            "model": request.get("model"),
            "draft": self.draft,
            "k": self.k,
            "messages": request.get("messages") if endpoint == "chat" else None,
            "prompt": request.get("prompt") if endpoint == "completion" else None,
            **reply,
        }
        try:
            self.writer.append(record)
        except OSError as err:
            log.error("eaglenest serve --record: could not append to %s: %s", self.writer.directory, err)


def read_answer(body: bytes, streamed: bool, endpoint: str) -> dict[str, Any]:
    """The reply, finish reason, usage and acceptance of one answer body: a JSON object, or server-sent events."""
    chunks: list[dict[str, Any]] = []
    if streamed:
        for line in body.decode("utf-8", errors="replace").splitlines():
            data = line[len("data:") :].strip() if line.startswith("data:") else ""
            if data and data != "[DONE]":
                try:
                    chunks.append(json.loads(data))
                except ValueError:
                    continue  # a keep-alive or comment line
    else:
        with contextlib.suppress(ValueError):  # a 200 with no JSON: a line with an empty reply
            chunks.append(json.loads(body))
    text: list[str] = []
    finish_reason = usage = acceptance = None
    for chunk in chunks:
        if not isinstance(chunk, dict):
            continue
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            if endpoint == "chat":
                part = (choice.get("delta") if streamed else choice.get("message")) or {}
                text.append(part.get("content") or "")
            else:
                text.append(choice.get("text") or "")
            finish_reason = choice.get("finish_reason") or finish_reason
        usage = chunk.get("usage") or usage
        spec = (chunk.get("metrics") or {}).get("speculative_decoding")
        if isinstance(spec, dict):
            acceptance = {key: spec[key] for key in ACCEPTANCE_FIELDS if key in spec}
    return {"reply": "".join(text), "finish_reason": finish_reason, "usage": usage, "acceptance": acceptance}
