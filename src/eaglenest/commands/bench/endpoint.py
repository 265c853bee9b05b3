"""One server's HTTP API as the bench uses it: its models, its counters, a completion; and the checks that two servers
serve the same model.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from eaglenest.core.errors import EaglenestError
from eaglenest.core.measure.spec_counters import MetricsReading, parse_metrics

HTTP_TIMEOUT_S = 10.0


class ServerGone(EaglenestError):
    """Nothing answers at a server's URL (``reason``: the connection's error)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


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
        try:
            with urllib.request.urlopen(self.url + path, timeout=HTTP_TIMEOUT_S) as response:
                return response.read().decode("utf-8", errors="replace")
        except urllib.error.HTTPError as err:
            raise EaglenestError(f"{self.flag} {self.url}: GET {path} answered {err.code} {err.reason}; is it a "
                                 "vLLM OpenAI-compatible server?") from None
        except (urllib.error.URLError, OSError) as err:
            reason = str(getattr(err, "reason", err))
            raise ServerGone(f"{self.flag} {self.url}: no server answers ({reason}); start it (eaglenest serve, "
                             "vllm serve) or fix the URL", reason) from None

    def post(self, path: str, body: dict[str, Any], timeout_s: float) -> Any:
        """The JSON answer to POST ``path`` with the JSON ``body``.

        Raises:
            ServerGone: nothing answers.
            EaglenestError: an answer other than 200 with JSON (its first 200 characters).
        """
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            detail = " ".join(err.read().decode("utf-8", errors="replace").split())[:200]
            raise EaglenestError(f"{self.flag} {self.url}: POST {path} answered {err.code} {err.reason}: "
                                 f"{detail}") from None
        except json.JSONDecodeError as err:
            raise EaglenestError(f"{self.flag} {self.url}: POST {path} answered with no JSON ({err})") from None
        except (urllib.error.URLError, OSError) as err:
            reason = str(getattr(err, "reason", err))
            raise ServerGone(f"{self.flag} {self.url}: no server answers ({reason})", reason) from None

    def models(self) -> dict[str, dict[str, Any]]:
        """The models ``/v1/models`` lists, by id."""
        body = self.get("/v1/models")
        try:
            listed = json.loads(body)["data"]
            return {str(m["id"]): m for m in listed}
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise EaglenestError(f"{self.flag} {self.url}: /v1/models is not an OpenAI model list "
                                 f"({type(err).__name__}); is it an OpenAI-compatible server?") from None

    def counters(self) -> MetricsReading:
        return parse_metrics(self.get("/metrics"), f"{self.flag} {self.url}/metrics")


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
            raise EaglenestError(f"{draft.flag} {draft.url} serves {sorted(served) or 'no model'}; name the one to "
                                 "benchmark with --model")
        wanted = next(iter(served))
    if wanted not in served:
        raise EaglenestError(f"{draft.flag} {draft.url} serves {sorted(served)}, not {wanted!r} ({why}); point "
                             f"{draft.flag} at a server of that model, or pass --model")
    return served[wanted]


def require_model(baseline: Endpoint, model: str, draft: Endpoint) -> None:
    """Refuses a baseline endpoint that does not serve ``model``, the one the draft endpoint serves."""
    other = baseline.models()
    if model not in other:
        raise EaglenestError(f"{baseline.flag} {baseline.url} serves {sorted(other)}, not {model!r} (what "
                             f"{draft.flag} serves): the two endpoints must serve the same model")


def require_spec_decode(draft: Endpoint, model: str) -> None:
    """Refuses a draft endpoint whose ``/metrics`` has no speculative-decoding counters."""
    if draft.counters().spec is None:
        raise EaglenestError(f"{draft.flag} {draft.url}: its /metrics has no vllm:spec_decode_* counters, so it "
                             f"serves {model} without speculative decoding; start it with the draft (eaglenest "
                             "serve, or vllm serve --speculative-config ...)")


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
