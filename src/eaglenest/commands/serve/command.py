"""The server's command: vLLM's OpenAI-compatible server for the verifier, with the draft (its K, and its K per
batch size where a schedule was measured for it) or a baseline, and the flags a user passes after ``--``."""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from eaglenest.artifacts.draft_hash import draft_fingerprint
from eaglenest.artifacts.free_record import FREE_RECORD_FILE, measured_ngram, measured_suffix
from eaglenest.artifacts.k_record import K_RECORD_FILE, served_k
from eaglenest.artifacts.serve_schedule import (
    SCHEDULE_FILE,
    Schedule,
    ScheduleChoice,
    fit_schedule,
    schedule_text,
    served_schedule,
)
from eaglenest.artifacts.traffic import DEFAULT_MAX_FILE_BYTES
from eaglenest.commands.serve.access import REDACTED, SECRET_ENV, flag_value, secrets_to_env
from eaglenest.commands.serve.record import (
    MIDDLEWARE,
    RECORD_DIR_ENV,
    RECORD_DRAFT_ENV,
    RECORD_K_ENV,
    RECORD_MAX_BYTES_ENV,
)
from eaglenest.core.errors import EaglenestError, InputFileError
from eaglenest.core.vllm_support import (
    DEFAULT_CPU_KVCACHE_GIB,
    VLLM_DTYPES,
    VLLM_EXECUTIONS,
    compile_env,
    runs_eagerly,
    serving_dtype,
)

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# What `--baseline` serves instead of the draft (None: the draft itself).
BASELINES = (None, "ngram", "suffix", "none")
# vLLM flags the command sets from eaglenest's own: passed after ``--`` they would contradict them.
OWN_FLAGS = {
    "--model": "--verifier",
    "--speculative-config": "--draft, --num-speculative-tokens and --schedule",
    "--host": "--host",
    "--port": "--port",
    "--dtype": "--dtype",
    "--served-model-name": "--served-model-name",
}


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
        prefix = [
            f"{key}={REDACTED if key in SECRET_ENV else shlex.quote(value)}" for key, value in sorted(self.env.items())
        ]
        return " ".join(prefix + [shlex.quote(a) for a in self.argv])


def server_max_num_seqs(vllm_args: list[str]) -> int | None:
    """The largest batch the server will run: ``--max-num-seqs`` after ``--``, else vLLM's default for the installed
    build and the ranks the flags ask for; None where neither is known (no vLLM here).

    Raises:
        EaglenestError: a flag value that is not a whole number (one line).
    """
    from eaglenest.core.vllm_schedule import default_max_num_seqs

    sizes = {}
    for names in (("--max-num-seqs",), ("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp")):
        value = flag_value(vllm_args, *names)
        try:
            sizes[names[0]] = None if value is None else int(value)
        except ValueError:
            raise EaglenestError(f"{names[0]} {value} after --: expected a whole number") from None
    if sizes["--max-num-seqs"] is not None:
        return sizes["--max-num-seqs"]
    return default_max_num_seqs((sizes["--tensor-parallel-size"] or 1) * (sizes["--pipeline-parallel-size"] or 1))


def _schedule_for(
    draft_dir: Path, k: int, schedule_file: Path | None, explicit: bool, vllm_args: list[str]
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
        raise InputFileError(
            f"{schedule_file}: vLLM refuses the schedule {schedule_text(schedule)} at K={k} and "
            f"max_num_seqs {max_num_seqs}: {refusal}; pass --no-schedule"
        )
    return ScheduleChoice(schedule, choice.why)


@dataclass(frozen=True)
class ServeOptions:
    """What the server serves and how: ``eaglenest serve``'s flags, which ``eaglenest bench --serve`` sets too.

    Attributes:
        verifier_dir: The verifier stage's output (``models/verifier``, with verifier.json).
        draft_dir: The EAGLE-3 draft (``models/draft``).
        host: Address to listen on.
        port: Port to listen on.
        dtype: ``auto`` (an fp32 checkpoint is served in bfloat16), float32, bfloat16 or float16.
        num_speculative_tokens: K, the drafts per verify step; None: the fastest K the k_sweep stage measured
            for this draft (``k_sweep_file``), else the draft's own (``train.ttt_steps``):
            :func:`eaglenest.artifacts.k_record.served_k`.
        k_sweep_file: The K record; None: not consulted.
        served_model_name: The name clients ask for; None: the verifier's (``verifier.name``, the hub id).
        vllm_args: Further vLLM server flags, appended as given; none of ``OWN_FLAGS``. The value of each of
            ``SECRET_FLAGS`` goes to the server in its environment variable instead (:func:`secrets_to_env`).
        baseline: None serves the draft; ``"none"`` the verifier alone, ``"ngram"`` with vLLM's n-gram drafting
            and ``"suffix"`` with its suffix decoding, each at the setting the free_sweep stage measured fastest for
            this verifier (``ngram_file``), else vLLM's defaults at the draft's K: what ``eaglenest bench
            --baseline-url`` compares against.
        ngram_file: The free drafters' record (free_sweep's); None: not consulted.
        schedule_file: The schedule record the draft's K per batch size is read from; None: the same K at every
            batch size. Baselines never take one.
        schedule_explicit: The user named ``schedule_file``: refuse it, rather than pass it over, where it is
            missing or was measured on another draft or at another K.
        record_dir: Record every answered chat and completion request there (:mod:`.record`); None: record nothing.
        record_max_bytes: With ``record_dir``: start a new traffic file once the newest would grow past this.
        execution: ``auto`` (eager on vLLM's CPU build, compiled on GPUs), eager or compiled
            (:func:`eaglenest.core.vllm_support.runs_eagerly`).
        hybrid_file: Serve the hybrid of the draft with suffix decoding at the setting evaluate measured for this
            draft (``metrics/eval/details.json``, :func:`eaglenest.artifacts.evaluation.measured_hybrid`); None: the
            draft alone (or the baseline).
    """

    verifier_dir: Path
    draft_dir: Path
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "auto"
    num_speculative_tokens: int | None = None
    k_sweep_file: Path | None = K_RECORD_FILE
    served_model_name: str | None = None
    vllm_args: tuple[str, ...] = ()
    baseline: str | None = None
    ngram_file: Path | None = FREE_RECORD_FILE
    schedule_file: Path | None = SCHEDULE_FILE
    schedule_explicit: bool = False
    record_dir: Path | None = None
    record_max_bytes: int = DEFAULT_MAX_FILE_BYTES
    execution: str = "auto"
    hybrid_file: Path | None = None


def _recording(options: ServeOptions, argv: list[str], vllm_args: list[str], served_k: int | None) -> dict[str, str]:
    """Adds the recording middleware to ``argv`` (and, for a drafting server, vLLM's per-request acceptance in each
    answer, unless the flags after ``--`` choose a level); returns the environment that configures it."""
    assert options.record_dir is not None
    if options.record_max_bytes < 1:
        raise EaglenestError(f"--record-max-mb: expected more than 0 (got {options.record_max_bytes / 2**20:g})")
    argv += ["--middleware", MIDDLEWARE]
    drafting = "--speculative-config" in argv
    chosen = flag_value(vllm_args, "--per-request-spec-decode-metrics", "--per_request_spec_decode_metrics")
    if drafting and chosen is None:
        argv += ["--per-request-spec-decode-metrics", "summary"]
    env = {RECORD_DIR_ENV: str(options.record_dir.resolve()), RECORD_MAX_BYTES_ENV: str(options.record_max_bytes)}
    if options.baseline is None:  # the draft: its fingerprint says which draft the acceptance is of
        env[RECORD_DRAFT_ENV] = draft_fingerprint(options.draft_dir)
    if served_k is not None:
        env[RECORD_K_ENV] = str(served_k)
    return env


def _hybrid_flags(options: ServeOptions, argv: list[str], vllm_args: list[str]) -> tuple[str, int]:
    """Adds the hybrid's ``--speculative-config`` and ``--additional-config`` (which enables eaglenest's drafter
    plugin for this server alone) to ``argv``; returns where its setting came from, in words, and its largest K.

    Raises:
        EaglenestError: the hybrid asked for with a baseline, a K or ``--additional-config`` of the user's, or no
            hybrid measured for this draft (one line).
    """
    from eaglenest.artifacts.evaluation import measured_hybrid
    from eaglenest.core.drafter.config import CONFIG_KEY, speculative_config

    assert options.hybrid_file is not None
    if options.baseline is not None:
        raise EaglenestError(f"--hybrid with --baseline {options.baseline}: serve one of them")
    if options.num_speculative_tokens is not None:
        raise EaglenestError(
            "--num-speculative-tokens with --hybrid: the hybrid serves the Ks evaluate measured it at; drop one"
        )
    if flag_value(vllm_args, "--additional-config") is not None:
        raise EaglenestError("--additional-config after --: --hybrid sets it (the drafter's settings)")
    config, why = measured_hybrid(options.hybrid_file, options.draft_dir)
    argv += [
        "--speculative-config",
        json.dumps(speculative_config(str(options.draft_dir.resolve()), config)),
        "--additional-config",
        json.dumps({CONFIG_KEY: config.model_dump()}),
    ]
    suffix = config.suffix
    said = f"suffix decoding K = {suffix.k}, depth {suffix.max_tree_depth}" if suffix else "no suffix decoding"
    return f"the hybrid: the draft at K = {config.draft_k}, {said} ({why}; {options.hybrid_file})", config.max_k


def build_command(options: ServeOptions, cpu_build: bool = True) -> ServeCommand:
    """The vLLM server command for the verifier stage's folder and the draft (or a baseline without it).

    Args:
        options: What to serve and how.
        cpu_build: vLLM's CPU build: a KV cache size, and eager unless ``options.execution`` is compiled, as the
            vllm back ends run.
    """
    # Here, not at the top: the draft's module imports torch, which building the parser must not.
    from eaglenest.artifacts.draft import vllm_speculative_config
    from eaglenest.artifacts.verifier import load_verifier_info

    baseline = options.baseline
    for arg in options.vllm_args:
        flag = arg.split("=", 1)[0]
        if flag in OWN_FLAGS:
            raise EaglenestError(
                f"{flag} after --: eaglenest serve sets it; use eaglenest serve's own {OWN_FLAGS[flag]} (before --)"
            )

    if options.dtype not in VLLM_DTYPES:
        raise EaglenestError(f"--dtype {options.dtype}: expected one of {', '.join(VLLM_DTYPES)}")
    if options.execution not in VLLM_EXECUTIONS:
        raise EaglenestError(f"--execution {options.execution}: expected one of {', '.join(VLLM_EXECUTIONS)}")
    info, model_dir = load_verifier_info(options.verifier_dir)
    choice = served_k(options.draft_dir, options.num_speculative_tokens, options.k_sweep_file)
    k = choice.k
    if baseline not in BASELINES:
        raise EaglenestError(f"--baseline {baseline}: expected one of {', '.join(b for b in BASELINES if b)}")
    served_name = options.served_model_name or info.name
    vllm_args, secret_env = secrets_to_env(list(options.vllm_args))
    argv = [
        sys.executable,
        "-m",
        SERVER_MODULE,
        "--model",
        str(model_dir.resolve()),
        "--served-model-name",
        served_name,
        str(model_dir.resolve()),
    ]
    scheduled = ScheduleChoice(None, "")
    hybrid_reason = ""
    if options.hybrid_file is not None:
        hybrid_reason, k = _hybrid_flags(options, argv, vllm_args)
    elif baseline is None:
        scheduled = _schedule_for(options.draft_dir, k, options.schedule_file, options.schedule_explicit, vllm_args)
        speculative = vllm_speculative_config(options.draft_dir.resolve(), k)
        if scheduled.schedule is not None:
            speculative["num_speculative_tokens_per_batch_size"] = [list(entry) for entry in scheduled.schedule]
        argv += ["--speculative-config", json.dumps(speculative)]
    elif baseline in ("ngram", "suffix"):
        free = (measured_ngram if baseline == "ngram" else measured_suffix)(info.fingerprint, k, options.ngram_file)
        argv += ["--speculative-config", json.dumps(free.setting.speculative_config())]
    computed_in = serving_dtype(model_dir, options.dtype)
    argv += ["--host", options.host, "--port", str(options.port), "--dtype", computed_in]
    if info.trust_remote_code:
        argv.append("--trust-remote-code")
    env: dict[str, str] = {"VLLM_NO_USAGE_STATS": "1", **secret_env}  # nothing leaves the machine
    if cpu_build:  # the CPU KV cache needs a size, as in vllm_support.engine_kwargs
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", DEFAULT_CPU_KVCACHE_GIB)
    if runs_eagerly(options.execution, cpu_build):
        argv.append("--enforce-eager")
    else:
        env.update(compile_env(cpu_build))
    argv += vllm_args
    if hybrid_reason:
        reason, served_k_of = hybrid_reason, k
    elif baseline is None:
        reason, served_k_of = f"the draft, {choice.line()}", k
    elif baseline == "none":
        reason, served_k_of = "baseline: no drafting", None
    else:
        reason, served_k_of = f"baseline: {free.line()}", free.setting.k
    if options.record_dir is not None:
        env.update(_recording(options, argv, vllm_args, served_k_of))
    return ServeCommand(
        argv,
        env,
        reason,
        served_name,
        k=served_k_of,
        schedule=scheduled.schedule,
        schedule_reason=scheduled.line() if baseline is None else "",
        dtype=computed_in,
    )
