"""Who may reach the server, and what its command line shows: the port checked before a model loads, secrets
moved from vLLM's flags into its environment (``ps`` shows a command line to every user), and listening beyond
loopback refused without an API key."""

from __future__ import annotations

import itertools
import os
import socket
import sys

from eaglenest.core.errors import EaglenestError

# vLLM flags whose value is a secret, and the environment variable that carries the same secret: moved there, the
# secret is in neither vLLM's argv (``ps`` shows it to every user), its log of its arguments, nor the command
# eaglenest prints and bench records.
SECRET_FLAGS = {"--api-key": "VLLM_API_KEY", "--hf-token": "HF_TOKEN"}
SECRET_ENV = frozenset(SECRET_FLAGS.values())
API_KEY_ENV = SECRET_FLAGS["--api-key"]
REDACTED = "***"


def check_port_free(host: str, port: int) -> None:
    """Refuses a port something already listens on, before a minute of model loading is spent.

    The probe binds with SO_REUSEADDR as the server's own socket (uvicorn) does, so a port left in
    TIME_WAIT by a stopped server counts as free, and a listening one as taken.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except PermissionError:
            raise EaglenestError(
                f"--port {port}: not allowed to listen on {host}:{port}; pick a port above 1023 with --port"
            ) from None
        except OSError as err:
            raise EaglenestError(
                f"--port {port}: {host}:{port} is already in use ({err.strerror}); stop what "
                "listens there or pick another port with --port"
            ) from None


def flag_value(args: list[str], *names: str) -> str | None:
    """The value of the last of ``names`` in vLLM flags (``--flag V`` or ``--flag=V``); None where none is given."""
    value = None
    for i, arg in enumerate(args):
        flag, equals, inline = arg.partition("=")
        if flag in names:
            value = inline if equals else (args[i + 1] if i + 1 < len(args) else None)
    return value


def secrets_to_env(vllm_args: list[str]) -> tuple[list[str], dict[str, str]]:
    """vLLM flags with each of ``SECRET_FLAGS`` taken out, and the environment variables that carry their values.

    Raises:
        EaglenestError: ``--api-key`` with several keys (the environment variable holds one).
    """
    kept: list[str] = []
    env: dict[str, str] = {}
    i = 0
    while i < len(vllm_args):
        flag, equals, inline = vllm_args[i].partition("=")
        following = list(itertools.takewhile(lambda arg: not arg.startswith("-"), vllm_args[i + 1 :]))
        values = [inline] if equals else following[:1] if flag == "--hf-token" else following  # --hf-token: one
        if flag not in SECRET_FLAGS or not values:  # a bare --hf-token means vLLM's cached login: no secret in it
            kept.append(vllm_args[i])
            i += 1
            continue
        if len(values) > 1:
            raise EaglenestError(
                f"{flag} after --: {len(values)} keys; give the one key in {SECRET_FLAGS[flag]} "
                f"(export {SECRET_FLAGS[flag]}=...), which keeps it out of the command line"
            )
        env[SECRET_FLAGS[flag]] = values[0]
        i += 1 if equals else 2
    return kept, env


def check_exposure(host: str, port: int, env: dict[str, str], no_api_key: bool) -> None:
    """Refuses to serve beyond this machine without an API key, unless ``--no-api-key`` says so (then warns).

    Raises:
        EaglenestError: ``host`` is not a loopback address and no key is set (one line saying how to give one).
    """
    from eaglenest.core.params import is_loopback  # pydantic: not where the parser is built (eaglenest --help)

    if is_loopback(host) or env.get(API_KEY_ENV) or os.environ.get(API_KEY_ENV):
        return
    exposed = (
        f"--host {host}: vLLM would answer at {host}:{port} without an API key, so anyone who reaches it "
        "can run the model"
    )
    if not no_api_key:
        raise EaglenestError(
            f"{exposed}; export {API_KEY_ENV}=<key> (or pass --api-key after --), or pass --no-api-key to serve it open"
        )
    print(f"eaglenest serve: WARNING: {exposed} (--no-api-key)", file=sys.stderr, flush=True)
