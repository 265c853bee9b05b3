"""One server's HTTP API as the bench uses it: its models, its counters, a completion; and the checks that two servers
serve the same model.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from eaglenest.core.errors import EaglenestError
from eaglenest.core.measure.spec_counters import MetricsReading, parse_metrics

HTTP_TIMEOUT_S = 10.0
# The environment variables the servers' API key is read from, the first set first: eaglenest's own, then the one
# vLLM's server reads (one export serves both ends on one machine). Never OPENAI_API_KEY: it often holds a key for
# api.openai.com, which must not go to the server under test.
API_KEY_ENVS = ("EAGLENEST_API_KEY", "VLLM_API_KEY")
# The most bench reads of one answer: /metrics and a completion with its top log-probs are far below it, and a
# server that sends more is not the server bench expects.
MAX_RESPONSE_BYTES = 8 * 2**20
# What bench reads of an error answer's body: its first line says why.
ERROR_BODY_BYTES = 4096
# Terminal escape sequences: CSI (ESC [ ... final byte), OSC (ESC ] ... BEL or ESC \), and two-character ones.
TERMINAL_ESCAPE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])")


class ServerGone(EaglenestError):
    """Nothing answers at a server's URL (``reason``: the connection's error)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def api_key() -> str | None:
    """The servers' API key: the first of ``API_KEY_ENVS`` that is set; None where none is."""
    return next((os.environ[name] for name in API_KEY_ENVS if os.environ.get(name)), None)


def auth_headers() -> dict[str, str]:
    """The header that carries :func:`api_key` to a server (none without a key)."""
    key = api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def printable(text: str) -> str:
    """A server's string as bench prints or records it: on one line, its escape sequences dropped and every other
    character a terminal would act on (carriage returns, line breaks, controls) a space."""
    return " ".join("".join(ch if ch.isprintable() else " " for ch in TERMINAL_ESCAPE.sub("", text)).split())


@dataclass(frozen=True)
class Endpoint:
    """One server: its role in the comparison, the flag that named it (or, started here, what it is), and its base
    URL (no ``/v1``)."""

    role: str
    flag: str
    url: str

    def get(self, path: str) -> str:
        """The body of GET ``path``.

        Raises:
            EaglenestError: nothing answers, or not with 200 (one line naming the flag and the URL).
        """
        request = urllib.request.Request(self.url + path, headers=auth_headers())
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
                return self._read(response, f"GET {path}").decode("utf-8", errors="replace")
        except urllib.error.HTTPError as err:
            raise EaglenestError(
                f"{self.flag} {self.url}: GET {path} answered {err.code} {printable(str(err.reason))}"
                f"; {_refusal_hint(err.code)}"
            ) from None
        except (urllib.error.URLError, OSError) as err:
            reason = printable(str(getattr(err, "reason", err)))
            raise ServerGone(
                f"{self.flag} {self.url}: no server answers ({reason}); start it (eaglenest serve, "
                "vllm serve) or fix the URL",
                reason,
            ) from None

    def _read(self, response: Any, request: str) -> bytes:
        """An answer's body, refused past ``MAX_RESPONSE_BYTES`` (one line naming the server and the cap)."""
        body = response.read(MAX_RESPONSE_BYTES + 1)
        if len(body) > MAX_RESPONSE_BYTES:
            raise EaglenestError(
                f"{self.flag} {self.url}: {request} answered more than {MAX_RESPONSE_BYTES // 2**20} "
                "MiB, more than bench reads of one answer; is it a vLLM OpenAI-compatible server?"
            )
        return body

    def post(self, path: str, body: dict[str, Any], timeout_s: float) -> Any:
        """The JSON answer to POST ``path`` with the JSON ``body``.

        Raises:
            ServerGone: nothing answers.
            EaglenestError: an answer other than 200 with JSON (its first 200 characters).
        """
        request = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json", **auth_headers()},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return json.loads(self._read(response, f"POST {path}"))
        except urllib.error.HTTPError as err:
            detail = printable(err.read(ERROR_BODY_BYTES).decode("utf-8", errors="replace"))[:200]
            raise EaglenestError(
                f"{self.flag} {self.url}: POST {path} answered {err.code} {printable(str(err.reason))}: {detail}"
            ) from None
        except json.JSONDecodeError as err:
            raise EaglenestError(f"{self.flag} {self.url}: POST {path} answered with no JSON ({err})") from None
        except (urllib.error.URLError, OSError) as err:
            reason = printable(str(getattr(err, "reason", err)))
            raise ServerGone(f"{self.flag} {self.url}: no server answers ({reason})", reason) from None

    def models(self) -> dict[str, dict[str, Any]]:
        """The models ``/v1/models`` lists, by id."""
        body = self.get("/v1/models")
        try:
            listed = json.loads(body)["data"]
            return {printable(str(m["id"])): {**m, "id": printable(str(m["id"]))} for m in listed}
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise EaglenestError(
                f"{self.flag} {self.url}: /v1/models is not an OpenAI model list "
                f"({type(err).__name__}); is it an OpenAI-compatible server?"
            ) from None

    def counters(self) -> MetricsReading:
        return parse_metrics(self.get("/metrics"), f"{self.flag} {self.url}/metrics")


def _refusal_hint(status: int) -> str:
    if status == 401:
        return f"set {' or '.join(API_KEY_ENVS)} to the server's API key (bench sends it as a bearer token)"
    return "is it a vLLM OpenAI-compatible server?"


def base_url(url: str, flag: str) -> str:
    """The server's root URL: an OpenAI base URL's ``/v1`` and trailing slashes dropped."""
    parsed = urllib.parse.urlsplit(url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise EaglenestError(f"{flag} {url}: expected an http(s) URL such as http://127.0.0.1:8000")
    path = parsed.path.rstrip("/").removesuffix("/v1").rstrip("/")
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, path, "", ""))


def check_models(draft: Endpoint, baseline: Endpoint, model: str | None, expected: str | None) -> dict[str, Any]:
    """The model both endpoints serve, as the draft's ``/v1/models`` lists it.

    Args:
        draft: The speculative endpoint.
        baseline: The baseline endpoint.
        model: ``--model``; None: ``expected``, else the draft endpoint's only model.
        expected: The verifier record's name, when ``--tokenizer`` is the verifier stage's folder.
    """
    served = draft_model(draft, model, expected)
    require_model(baseline, str(served["id"]), draft)
    return served


def draft_model(draft: Endpoint, model: str | None, expected: str | None) -> dict[str, Any]:
    """The model to benchmark, as the draft endpoint's ``/v1/models`` lists it (see :func:`check_models`)."""
    served = draft.models()
    wanted = model or expected
    why = "--model" if model else "the verifier's name in --tokenizer's verifier.json; --model overrides it"
    if wanted is None:
        if len(served) != 1:
            raise EaglenestError(
                f"{draft.flag} {draft.url} serves {sorted(served) or 'no model'}; name the one to "
                "benchmark with --model"
            )
        wanted = next(iter(served))
    if wanted not in served:
        raise EaglenestError(
            f"{draft.flag} {draft.url} serves {sorted(served)}, not {wanted!r} ({why}); point "
            f"{draft.flag} at a server of that model, or pass --model"
        )
    return served[wanted]


def require_model(baseline: Endpoint, model: str, draft: Endpoint) -> None:
    """Refuses a baseline endpoint that does not serve ``model``, the one the draft endpoint serves."""
    other = baseline.models()
    if model not in other:
        raise EaglenestError(
            f"{baseline.flag} {baseline.url} serves {sorted(other)}, not {model!r} (what "
            f"{draft.flag} serves): the two endpoints must serve the same model"
        )


def require_spec_decode(draft: Endpoint, model: str) -> None:
    """Refuses a draft endpoint whose ``/metrics`` has no speculative-decoding counters."""
    if draft.counters().spec is None:
        raise EaglenestError(
            f"{draft.flag} {draft.url}: its /metrics has no vllm:spec_decode_* counters, so it "
            f"serves {model} without speculative decoding; start it with the draft (eaglenest "
            "serve, or vllm serve --speculative-config ...)"
        )


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=auth_headers()), timeout=HTTP_TIMEOUT_S
        ) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
