"""The ``eaglenest`` command. Heavy imports happen inside the subcommands, so ``doctor`` runs anywhere."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from eaglenest.artifacts.k_record import K_RECORD_FILE
from eaglenest.commands.bench import DEFAULT_CONCURRENCY, DEFAULT_OUT, DEFAULT_PORT, DEFAULT_SERVER_TIMEOUT_S
from eaglenest.core.errors import EaglenestError

DESCRIPTION = (
    "eaglenest trains EAGLE-3 speculative-decoding drafts for a verifier LLM and measures how much faster they "
    "make it. The pipeline runs with DVC (`dvc repro`: stages in dvc.yaml, every knob in params.yaml); these "
    "commands set it up, check and inspect what it makes, compare runs, and serve the draft with vLLM."
)
EPILOG = "`eaglenest COMMAND --help` describes each command. Reference: docs/cli.md and docs/params.md."


def _doctor(args: argparse.Namespace) -> int:
    from eaglenest.commands.doctor import doctor

    return doctor(args.params)


def _inspect(args: argparse.Namespace) -> int:
    from eaglenest.commands.inspect import inspect_path

    for path in args.paths:
        print("\n".join(inspect_path(Path(path))))
    return 0


def _export(args: argparse.Namespace) -> int:
    from eaglenest.commands.export import export_speculators

    rows = export_speculators(Path(args.prepared), Path(args.hidden_states), Path(args.out))
    print(f"exported {rows} rows to {args.out} (hs_{{i}}.safetensors in {args.out}/hidden_states); train on it with "
          f"`speculators train --data-path {args.out}`")
    return 0


def _import(args: argparse.Namespace) -> int:
    from eaglenest.commands.importer import import_dump

    counts = import_dump(args.format, Path(args.source), Path(args.out), args.val_fraction)
    print(f"imported {counts['samples']} samples ({counts['layers']} layers x {counts['hidden_size']}) into "
          f"{args.out}\nuse it with params: prepare.source: [import:{args.out}], extract.backend: import, "
          f"extract.import_path: {args.out}/hidden_states")
    return 0


def _report(args: argparse.Namespace) -> int:
    if args.readme:
        from eaglenest.commands.generated import README_TARGETS, regenerate

        if args.heads or args.base:
            raise EaglenestError("--readme takes no revisions: it renders the workspace's metrics into README.md")
        return regenerate(Path(args.repo), README_TARGETS, args.check)
    if args.base is None:
        raise EaglenestError("give BASE, the revision to compare against (or --readme)")
    from eaglenest.commands.report import write_report

    print(write_report(Path(args.repo), args.heads, args.base, Path(args.out), args.samples, args.seed))
    return 0


def _summary(args: argparse.Namespace) -> int:
    from eaglenest.commands.summary import summary_lines

    print("\n".join(summary_lines(Path(args.repo))))
    return 0


def _remote(args: argparse.Namespace) -> int:
    from eaglenest.commands.remote import remote

    return remote(args.action, Path(args.repo), Path(args.dir), args.name)


def _serve(args: argparse.Namespace) -> int:
    from eaglenest.commands.serve import serve

    return serve(Path(args.verifier), Path(args.draft), args.host, args.port, args.dtype, args.print_command,
                 args.num_speculative_tokens, Path(args.k_sweep), args.served_model_name, args.vllm_args,
                 args.baseline)


def _k_sweep(args: argparse.Namespace) -> int:
    from eaglenest.commands.k_sweep import run_sweep, summary_lines

    print("\n".join(summary_lines(run_sweep(Path(args.params), Path(args.verifier), Path(args.draft),
                                            Path(args.prepared), Path(args.out), args.ks, args.repeats))))
    return 0


# bench's flags that only say how --serve starts the servers; None: not given.
BENCH_SERVE_FLAGS = {"baseline": "--baseline", "port": "--port", "verifier": "--verifier", "draft": "--draft",
                     "dtype": "--dtype", "num_speculative_tokens": "--num-speculative-tokens",
                     "server_timeout": "--server-timeout"}


def _bench(args: argparse.Namespace) -> int:
    from eaglenest.commands.bench import BenchConfig, ServeSetup, bench

    serve = None
    if args.serve:
        given = {key: getattr(args, key) for key in BENCH_SERVE_FLAGS if getattr(args, key) is not None}
        for key in ("verifier", "draft"):
            if key in given:
                given[key] = Path(given[key])
        if "server_timeout" in given:
            given["timeout_s"] = given.pop("server_timeout")
        serve = ServeSetup(**given, vllm_args=tuple(args.vllm_args))
    else:
        stray = [flag for key, flag in BENCH_SERVE_FLAGS.items() if getattr(args, key) is not None]
        if args.vllm_args:
            stray.append("flags after --")
        if stray:
            raise EaglenestError(f"{', '.join(stray)}: only with --serve (they say how bench starts the servers); "
                                 "add --serve, or drop them to benchmark --url and --baseline-url")
    return bench(BenchConfig(
        args.url, args.baseline_url, Path(args.prompts), model=args.model,
        tokenizer=None if args.tokenizer is None else Path(args.tokenizer), concurrency=tuple(args.concurrency),
        num_prompts=args.num_prompts, max_tokens=args.max_tokens, temperature=args.temperature,
        warmup_prompts=args.warmup_prompts, timeout_s=args.timeout, out=Path(args.out), tie_margin=args.tie_margin,
        serve=serve))


def _train_launch(args: argparse.Namespace) -> int:
    from eaglenest.commands.train_launch import train_launch

    return train_launch(args.rdzv_endpoint, args.rdzv_id, args.print)


def _init(args: argparse.Namespace) -> int:
    from eaglenest.commands.init import Gpus, init_params

    if (args.gpus is None) != (args.gpu_memory_gib is None):
        raise EaglenestError("--gpus and --gpu-memory-gib go together (the engines' widths need both); give both, "
                             "or neither to use the GPUs torch sees")
    gpus = None if args.gpus is None else Gpus(args.gpus, args.gpu_memory_gib)
    print("\n".join(init_params(args.verifier, Path(args.out), force=args.force, gpus=gpus)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="eaglenest", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"eaglenest {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_command = _command_adder(commands)
    doctor = add_command(
        "doctor", help="check the interpreter, the installed packages, the device and the cluster the work runs on"
    )
    doctor.add_argument("--params", type=Path, default=None,
                        help="params file whose cluster section is checked (default: the project's params.yaml)")
    doctor.set_defaults(func=_doctor)

    inspect = add_command(
        "inspect", help="show keys, shapes, dtypes, value ranges and token counts of dumps and checkpoints"
    )
    inspect.add_argument("paths", nargs="+", help="a .safetensors/.pt/.npy file, a checkpoint, dataset or folder")
    inspect.set_defaults(func=_inspect)

    exporter = add_command("export", help="write the prepared rows and their hidden states in speculators' "
                           "layout, one hs_{i}.safetensors per row (from shards or row files)")
    exporter.add_argument("--format", required=True, choices=["speculators"],
                          help="speculators: a prepare-data dataset with hidden_states/hs_{i}.safetensors inside, "
                          "as `speculators train --data-path` reads it")
    exporter.add_argument("--prepared", default="data/prepared", help="the prepare stage's dataset folder "
                          "(default: data/prepared)")
    exporter.add_argument("--hidden-states", default="data/hidden_states", help="the extract stage's folder "
                          "(default: data/hidden_states)")
    exporter.add_argument("--out", required=True, help="the folder to write (replaced whole, atomically)")
    exporter.set_defaults(func=_export)

    importer = add_command("import", help="turn hidden states dumped by other tools into eaglenest's layout")
    importer.add_argument("--format", required=True, choices=IMPORT_FORMAT_NAMES,
                          help="speculators-pt (one .pt per sample) or speculators (0.9 / vLLM hs_{i}.safetensors)")
    importer.add_argument("source", help="the dump (a folder)")
    importer.add_argument("--out", required=True, help="output folder: a dataset with hidden_states/ inside")
    importer.add_argument("--val-fraction", type=float, default=0.05, help="last rows held out for validation")
    importer.set_defaults(func=_import)

    report = add_command(
        "report", help="Markdown report of revisions against a base: headline metrics, a paired comparison of "
        "the evaluation records, and plots as PNG images"
    )
    report.add_argument("base", metavar="BASE", nargs="?", help="the revision to compare against: a git revision, "
                        "a DVC experiment name or 'workspace'")
    report.add_argument("heads", metavar="HEAD", nargs="*", help="the revisions compared with BASE, same kinds "
                        "(default: workspace)")
    report.add_argument("--out", default="report", help="output folder (report.md and PNG plots)")
    report.add_argument("--repo", default=".", help="the repository (default: the current folder)")
    report.add_argument("--samples", type=int, default=2000,
                        help="bootstrap resamples of the paired comparison (default: 2000, as evaluate's)")
    report.add_argument("--seed", type=int, default=0, help="seed of the resampling (default: 0, as evaluate's)")
    report.add_argument("--readme", action="store_true", help="instead of a report, render README.md's headline "
                        "figure and demo table from the workspace's metrics/eval.json")
    report.add_argument("--check", action="store_true", help="with --readme: write nothing, exit 1 if README.md's "
                        "figures differ from the metrics")
    report.set_defaults(func=_report)

    summary = add_command("summary", help="the headline figures of the workspace as a short table")
    summary.add_argument("--repo", default=".", help="the repository (default: the current folder)")
    summary.set_defaults(func=_summary)

    store = add_command(
        "remote", help="start, stop or check the team's S3 store on this machine and its DVC remote",
        description="The team's S3 store on this machine. start: runs SeaweedFS (weed mini) on free 127.0.0.1 "
        "ports (credentials made once, kept across restarts) and makes it the repository's default DVC remote in "
        ".dvc/config.local (nothing enters git); stop: stops it, keeping its objects; status: exit 0 where it runs; "
        "push-caches / pull-caches: prepare's caches to / from the remote. A remote elsewhere (AWS S3, GCS, "
        "MinIO): docs/team-remote.md.",
    )
    store.add_argument("action", choices=["start", "stop", "status", "push-caches", "pull-caches"],
                       help="push-caches / pull-caches: copy prepare's caches of regenerated replies and prompts "
                       "to / from the DVC remote --name (only entries the other side lacks)")
    store.add_argument("--dir", default=".eaglenest/store", help="the store's folder: objects, log and state "
                       "(default: .eaglenest/store; a second clone on this machine names the first one's)")
    store.add_argument("--name", default="team", help="the DVC remote's name (default: team)")
    store.add_argument("--repo", default=".", help="the repository (default: the current folder)")
    store.set_defaults(func=_remote)

    server = add_command(
        "serve", help="run vLLM's OpenAI-compatible server for the verifier with the trained draft",
        description="Run vLLM's OpenAI-compatible server for the verifier with the trained draft. Flags after "
        "-- go to vLLM as they are (for example: eaglenest serve -- --tensor-parallel-size 8 --max-model-len 8192).",
    )
    server.add_argument("--verifier", default="models/verifier", help="the verifier stage's output folder")
    server.add_argument("--draft", default="models/draft", help="the train stage's draft checkpoint")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    server.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    server.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="compute dtype; auto serves an fp32 checkpoint in bfloat16 (default: auto)")
    server.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                        help="drafts per verify step (default: the fastest K the k_sweep stage measured for this "
                        "draft, else the draft's own, train.ttt_steps)")
    server.add_argument("--k-sweep", default=str(K_RECORD_FILE), metavar="FILE",
                        help=f"the K record the default K is read from (default: {K_RECORD_FILE})")
    server.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="the model name clients ask for (default: the verifier's, verifier.name or its hub id)")
    server.add_argument("--baseline", choices=["ngram", "none"], default=None,
                        help="serve a baseline instead of the draft, for eaglenest bench --baseline-url: vLLM's "
                        "n-gram drafting at the same K, or the verifier alone (default: the draft)")
    server.add_argument("--print-command", action="store_true",
                        help="print the exact server command instead of running it")
    server.set_defaults(func=_serve)

    init = add_command(
        "init", help="write a params.yaml for a new verifier: aux layers, remote code, reasoning, draft layer and "
        "vocabulary, engine widths, each choice explained in a comment",
        description="Write a params.yaml for a new verifier. Reads its config.json, chat template and weight sizes "
        "(nothing is loaded, no code runs) and the GPUs torch sees; each value chosen for the verifier carries a "
        "comment saying why, and the file passes the strict params check.",
    )
    init.add_argument("verifier", metavar="VERIFIER", help="the verifier's model folder (config.json, weights, "
                      "tokenizer), or builtin:smollm2-135m-instruct")
    init.add_argument("--out", default="params.yaml", help="the file to write (default: params.yaml)")
    init.add_argument("--force", action="store_true", help="replace --out if it exists")
    init.add_argument("--gpus", type=int, default=None, metavar="N",
                      help="GPUs per node for the engines (default: those torch sees); with --gpu-memory-gib")
    init.add_argument("--gpu-memory-gib", type=float, default=None, metavar="GIB",
                      help="memory of one GPU in GiB (default: torch's reading); with --gpus")
    init.set_defaults(func=_init)

    sweep = add_command(
        "k-sweep", help="the k_sweep stage's timing by hand, for other Ks or rounds than params.yaml's k_sweep: "
        "the draft at each K, single-stream on the headline sets; records the fastest K for `eaglenest serve`"
    )
    sweep.add_argument("--ks", nargs="+", type=int, default=None, metavar="K",
                       help="the Ks to time (default: k_sweep.ks)")
    sweep.add_argument("--repeats", type=int, default=None, help="rounds on the same engines (default: "
                       "k_sweep.repeats)")
    sweep.add_argument("--out", default=str(K_RECORD_FILE), help=f"the K record (default: {K_RECORD_FILE}, the "
                       "stage's)")
    sweep.add_argument("--params", default="params.yaml", help="the pipeline's params (default: params.yaml)")
    sweep.add_argument("--verifier", default="models/verifier", help="the verifier stage's output folder")
    sweep.add_argument("--draft", default="models/draft", help="the train stage's draft checkpoint")
    sweep.add_argument("--prepared", default="data/prepared", help="the prepare stage's dataset (val sets)")
    sweep.set_defaults(func=_k_sweep)

    bencher = add_command(
        "bench", help="the served draft against a baseline server under load: tokens/s, latency, tau and speed-up "
        "at each concurrency, with vLLM's `vllm bench serve`",
        description="Benchmark the served draft against a baseline server (the same model without the draft, or "
        "with n-gram drafting) at each concurrency: tokens/s, latency and TTFT from vLLM's `vllm bench serve`, tau "
        "and per-position acceptance from the server's /metrics, the speed-up, the concurrency at which "
        "speculation stops paying and, at temperature 0, whether the outputs equal the baseline's (or leave it at "
        "a near-tie). Either both servers are running (--url, --baseline-url), or --serve starts them here, one "
        "after the other (flags after -- go to both). Writes bench.json and speedup.png.",
    )
    bencher.add_argument("--url", default=None, help="the server with the draft (eaglenest serve, or vllm serve "
                         "with --speculative-config), e.g. http://127.0.0.1:8000")
    bencher.add_argument("--baseline-url", default=None, help="the server of the same model without the draft "
                         "(or with n-gram drafting)")
    bencher.add_argument("--serve", action="store_true", help="instead of --url and --baseline-url: start the "
                         "draft server (eaglenest serve), run the whole sweep, stop it, then the same with the "
                         "baseline server, one at a time on 127.0.0.1:--port (logs in --out/raw)")
    bencher.add_argument("--baseline", choices=["none", "ngram"], default=None,
                         help="with --serve: the baseline server, the verifier alone (none) or with vLLM's n-gram "
                         "drafting (ngram) (default: none)")
    bencher.add_argument("--port", type=int, default=None, metavar="P",
                         help=f"with --serve: the port both servers listen on, in turn (default: {DEFAULT_PORT})")
    bencher.add_argument("--verifier", default=None, metavar="DIR",
                         help="with --serve: the verifier stage's output folder (default: models/verifier)")
    bencher.add_argument("--draft", default=None, metavar="DIR",
                         help="with --serve: the train stage's draft checkpoint (default: models/draft)")
    bencher.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                         help="with --serve: the servers' compute dtype, as eaglenest serve's (default: auto)")
    bencher.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                         help="with --serve: drafts per verify step, as eaglenest serve's (default: the fastest "
                         "K the k_sweep stage measured, else the draft's own)")
    bencher.add_argument("--server-timeout", type=float, default=None, metavar="S",
                         help="with --serve: seconds a started server may take to answer /v1/models (default: "
                         f"{DEFAULT_SERVER_TIMEOUT_S:g})")
    bencher.add_argument("--prompts", required=True, metavar="FILE", help="JSONL of {'messages': [...]}, "
                         "{'prompt': '...'} or question.jsonl {'turns': [...]} records (first turn asked), or one "
                         "of evaluate's shipped sets: builtin:humaneval, builtin:general, builtin:long (the same "
                         "prompt tokens evaluate decodes)")
    bencher.add_argument("--model", default=None, metavar="NAME", help="the served model name (default: the "
                         "verifier's name with --tokenizer models/verifier, else the one model --url serves); with "
                         "--serve, the name the servers serve it under")
    bencher.add_argument("--tokenizer", default=None, metavar="DIR", help="renders the prompts to "
                         "token ids with its chat template: the verifier stage's folder or the served model's "
                         "(default: --verifier's folder, models/verifier)")
    bencher.add_argument("--concurrency", nargs="+", type=int, default=DEFAULT_CONCURRENCY, metavar="C",
                         help="requests in flight, one run per value and endpoint (default: "
                         f"{' '.join(map(str, DEFAULT_CONCURRENCY))})")
    bencher.add_argument("--num-prompts", type=int, default=None, metavar="N", help="requests per run, the prompts "
                         "taken in turn (default: 4 x the highest concurrency)")
    bencher.add_argument("--max-tokens", type=int, default=64, metavar="M",
                         help="tokens generated per request (default: 64)")
    bencher.add_argument("--temperature", type=float, default=0.0, metavar="T",
                         help="sampling temperature; 0 also checks the outputs equal the baseline's (default: 0)")
    bencher.add_argument("--tie-margin", type=float, default=None, metavar="X",
                         help="at temperature 0, an output that leaves the baseline's where the draft's token is "
                         "among the baseline's top candidates at most X below its best log-prob is a near-tie, "
                         "not a difference (default: evaluate.bf16_tie_margin's default)")
    bencher.add_argument("--warmup-prompts", type=int, default=2, metavar="N",
                         help="requests of an unmeasured warm-up run per endpoint; 0: none (default: 2)")
    bencher.add_argument("--timeout", type=float, default=600.0, metavar="S",
                         help="seconds one run may take before the bench stops (default: 600)")
    bencher.add_argument("--out", default=str(DEFAULT_OUT), metavar="DIR",
                         help=f"bench.json, speedup.png and vLLM's raw results (default: {DEFAULT_OUT})")
    bencher.set_defaults(func=_bench)

    launcher = add_command(
        "train-launch", help="this node's part of a multi-node training run: torchrun's elastic launcher on the "
        "train stage, built from params.yaml (train.nproc, cluster.torchrun) and dvc.yaml",
        description="This node's part of a multi-node training run: torchrun's elastic launcher (c10d rendezvous, "
        "restarts from the last checkpoint) on the train stage, with the stage's script and paths from dvc.yaml "
        "and the node bounds, processes per node and restarts from cluster.torchrun. Run it on every node, in the "
        "checkout's root (scripts/cluster/train.sbatch does, under Slurm); then `dvc commit train` records the "
        "outputs. --print shows the line instead of running it.",
    )
    launcher.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                          help="the rendezvous, on the first node (default: cluster.torchrun.rdzv_endpoint)")
    launcher.add_argument("--rdzv-id", default=None, metavar="ID",
                          help="the job's rendezvous id, the same on every node (default: cluster.torchrun.rdzv_id)")
    launcher.add_argument("--print", action="store_true",
                          help="print the exact line (environment, torchrun and its flags, the stage) and exit")
    launcher.set_defaults(func=_train_launch)
    return parser



# The import formats, as commands/importer.py registers them (tests hold the two equal); named here so that
# building the parser does not import torch.
IMPORT_FORMAT_NAMES = ["speculators-pt", "speculators"]


def _command_adder(commands: Any) -> Any:
    """``commands.add_parser`` whose ``--help`` opens with a description: the given one, else the one-line help
    as a sentence."""

    def add(name: str, *, help: str, description: str | None = None) -> argparse.ArgumentParser:  # noqa: A002
        sentence = description or help[:1].upper() + help[1:].rstrip(".") + "."
        return commands.add_parser(name, help=help, description=sentence)

    return add


def _version() -> str:
    """The installed distribution's version (a source tree that was never installed has none)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("eaglenest")
    except PackageNotFoundError:
        return "(not installed)"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script.

    ``eaglenest serve ... -- FLAGS`` hands everything after ``--`` to vLLM's server, ``eaglenest bench --serve ...
    -- FLAGS`` to the servers it starts; no other command takes it.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    vllm_args: list[str] = []
    if "--" in argv:
        separator = argv.index("--")
        argv, vllm_args = argv[:separator], argv[separator + 1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    if vllm_args and args.command not in ("serve", "bench"):
        parser.error(f"{args.command}: takes no arguments after --; only `eaglenest serve -- FLAGS` and "
                     "`eaglenest bench --serve -- FLAGS` pass flags on (to vLLM)")
    args.vllm_args = vllm_args
    try:
        return args.func(args)
    except EaglenestError as err:
        print(f"eaglenest {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
