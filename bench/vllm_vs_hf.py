"""Benchmark (run by hand): the hf and vllm back ends on the same verifier, draft and inputs.

    .venv/bin/python bench/vllm_vs_hf.py --repo /path/to/pipeline --out /tmp/vllm_vs_hf.json

``--repo`` is a pipeline repository after ``dvc repro train`` (it reads ``models/verifier``,
``data/prepared`` and ``models/draft``; nothing is written into it). One run measures:

(a) regeneration (``prepare.regenerate``): ``--conversations`` built-in chitchat conversations (the
    first the prepare stage would pick), first reply, at most ``--max-new-tokens`` tokens, greedy, as the
    prepare stage runs it: length-sorted batches of ``--batch-size`` (``prepare.regenerate_batch_size``;
    hf pads each batch, vllm sends it as one ``generate`` call). hf computes in fp32; vllm
    (``prepare.regenerate_backend: vllm``) in bfloat16 and float32. Tokens/s is what
    ``metrics/prepare.json`` reports (generation only); the engine or model load is reported apart.
    Replies are compared with hf's, token for token.
(b) evaluation: ``stages/evaluate.py`` of this checkout with ``evaluate.backend`` hf and vllm
    (``evaluate.vllm.dtype`` bfloat16 and float32) on the same draft and ``--eval-prompts`` held-out
    chitchat prompts (the last ones of the shuffled set, which no prepare run of this size picks);
    every number of each ``eval.json`` is kept.
(c) extraction: ``stages/extract.py`` with ``extract.backend`` hf and vllm (bfloat16 and float32 compute;
    bf16 files either way) over the repo's prepared rows, into a temporary folder (``--skip-extract``).

Each measurement runs in its own interpreter (this script, ``--worker``), so that one engine's memory
and threads never weigh on the next and vLLM's spawned engine core starts under ``__main__``. Prints a
Markdown table; writes every number to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("bfloat16", "float32")


# --- workers (one per interpreter) ----------------------------------------------------------------------
def chitchat_conversations(count: int, *, from_end: bool = False, seed: int = 0) -> list[list[dict[str, str]]]:
    """Built-in chitchat conversations cut after their first reply, in the prepare stage's shuffled order.

    Args:
        count: How many.
        from_end: Take them from the end of the shuffled order (held out from any prepare run that reads
            fewer than the set's size minus ``count``).
        seed: The shuffle seed (``prepare.seed``).
    """
    from eaglenest.stages.prepare import trim_conversation
    from eaglenest.stages.prepare.sources import read_sources

    conversations = read_sources(["builtin:chitchat"])
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    if from_end:
        order.reverse()
    picked = []
    for i in order:
        messages = trim_conversation(conversations[i].messages, 1)
        if any(m["role"] == "assistant" for m in messages[1:]):
            picked.append(messages)
        if len(picked) == count:
            break
    return picked


def regeneration_worker(args: argparse.Namespace) -> dict[str, Any]:
    """Regenerates the conversations with one back end; returns timings and every reply's token ids."""

    from eaglenest.artifacts.verifier import load_tokenizer, load_verifier_info
    from eaglenest.core.chat import end_of_turn_ids
    from eaglenest.core.params import VllmEngineParams
    from eaglenest.stages.prepare.params import PrepareParams
    from eaglenest.stages.prepare.regenerate import BACKENDS, regenerate
    from eaglenest.stages.prepare.regenerate.job import GeneratorJob

    verifier_dir = args.repo / "models" / "verifier"
    info, model_dir = load_verifier_info(verifier_dir)
    tokenizer = load_tokenizer(verifier_dir)
    eos = end_of_turn_ids(tokenizer, model_dir)
    conversations = chitchat_conversations(args.conversations)
    batch_size = args.batch_size
    params = PrepareParams(
        regenerate_backend=args.backend,
        regenerate_vllm=VllmEngineParams(dtype=args.dtype or "auto"),
        regenerate_max_new_tokens=args.max_new_tokens,
        regenerate_batch_size=batch_size,
        max_len=args.max_len,
    )
    started = time.perf_counter()
    # As the prepare stage loads it (greedy: regenerate_temperature defaults to 0).
    generate = BACKENDS.get(args.backend).load(GeneratorJob(params, info, model_dir, tokenizer, eos))
    load_s = time.perf_counter() - started
    calls: list[tuple[list[int], list[int]]] = []

    def recorded(prompts: list[list[int]], seed: int) -> list[list[int]]:
        replies = generate(prompts, seed)
        calls.extend(zip(prompts, replies, strict=True))
        return replies

    with tempfile.TemporaryDirectory() as cache:
        _, stats = regenerate(
            conversations, recorded, tokenizer, params, fingerprint=args.backend, cache_dir=Path(cache)
        )
    return {
        "load_s": round(load_s, 1),
        "generate_s": round(stats.seconds, 2),
        "replies": stats.turns,
        "tokens": stats.tokens,
        "tokens_per_s": round(stats.tokens / stats.seconds, 1),
        "calls": calls,
    }


def run_worker(args: argparse.Namespace, backend: str, dtype: str | None) -> dict[str, Any]:
    """This script as a regeneration worker in a fresh interpreter; its JSON result plus the wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            "--repo",
            str(args.repo),
            "--conversations",
            str(args.conversations),
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--max-len",
            str(args.max_len),
            "--batch-size",
            str(args.batch_size),
            "--backend",
            backend,
            "--out",
            str(out),
        ] + (["--dtype", dtype] if dtype else [])
        started = time.perf_counter()
        result = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
        wall = time.perf_counter() - started
        if result.returncode != 0:
            return {"error": tail(result.stderr), "wall_s": round(wall, 1)}
        return {**json.loads(out.read_text()), "wall_s": round(wall, 1)}


# --- stage runs -----------------------------------------------------------------------------------------
def run_stage(
    stage: str,
    args: argparse.Namespace,
    overrides: dict[str, dict[str, Any]],
    work: Path,
    paths: dict[str, Path],
    metrics: Path,
) -> dict[str, Any]:
    """One stage script of this checkout on the repo's inputs with overridden params; its metrics JSON
    (read even when the stage failed, as evaluate writes them before refusing a lossy run), exit status
    and wall time."""
    params = yaml.safe_load((args.repo / "params.yaml").read_text())
    for section, values in overrides.items():
        params.setdefault(section, {}).update(values)
    params_file = work / f"params-{metrics.stem}.yaml"
    params_file.write_text(yaml.safe_dump(params, sort_keys=False))
    cmd = [
        sys.executable,
        str(ROOT / "stages" / f"{stage}.py"),
        "--params",
        str(params_file),
        *[f"--{name}={path}" for name, path in paths.items()],
        f"--metrics={metrics}",
    ]
    started = time.perf_counter()
    result = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
    outcome: dict[str, Any] = {"wall_s": round(time.perf_counter() - started, 1), "returncode": result.returncode}
    if result.returncode != 0:
        outcome["error"] = tail(result.stderr)
    if metrics.is_file():
        outcome["metrics"] = json.loads(metrics.read_text())
    return outcome


def tail(text: str, lines: int = 3) -> str:
    """The last lines of a child's stderr: where a stage or vLLM says what went wrong."""
    return "\n".join(text.strip().splitlines()[-lines:])


def evaluation(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """evaluate.backend hf and vllm (bf16, fp32) on the same draft and held-out prompts."""
    prompts = work / "eval_prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"messages": c[:-1]}) + "\n" for c in chitchat_conversations(args.eval_prompts, from_end=True)
        )
    )
    paths = {
        "verifier": args.repo / "models" / "verifier",
        "prepared": args.repo / "data" / "prepared",
        "draft": args.repo / "models" / "draft",
        "plots": work / "plots",
    }
    common = {
        "prompts": str(prompts),
        "num_prompts": args.eval_prompts,
        "max_new_tokens": args.max_new_tokens,
        "temperature": 0.0,
    }
    runs = {"hf": {"backend": "hf"}, **{f"vllm {d}": {"backend": "vllm", "vllm": {"dtype": d}} for d in DTYPES}}
    results = {}
    for label, values in runs.items():
        log(f"evaluate: {label}")
        results[label] = run_stage(
            "evaluate",
            args,
            {"evaluate": {**common, **values}},
            work,
            {**paths, "plots": work / f"plots-{label.replace(' ', '-')}"},
            work / f"eval-{label.replace(' ', '-')}.json",
        )
    return results


def extraction(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """extract.backend hf and vllm (bf16, fp32 compute) over the repo's prepared rows."""
    runs = {"hf": {"backend": "hf"}, **{f"vllm {d}": {"backend": "vllm", "vllm": {"dtype": d}} for d in DTYPES}}
    results = {}
    for label, values in runs.items():
        log(f"extract: {label}")
        name = label.replace(" ", "-")
        paths = {
            "verifier": args.repo / "models" / "verifier",
            "prepared": args.repo / "data" / "prepared",
            "out": work / f"hs-{name}",
        }
        results[label] = run_stage(
            "extract", args, {"extract": {"device": "auto", **values}}, work, paths, work / f"extract-{name}.json"
        )
    return results


# --- report ---------------------------------------------------------------------------------------------
def equal_replies(reference: dict[str, Any], other: dict[str, Any]) -> str:
    """How many of ``other``'s replies equal ``reference``'s token for token, as "n / total".

    Replies are matched by position: both back ends regenerate the same conversations in the same
    (length-sorted) order, and some conversations share their prompt ("hi"), so prompts are no key.
    """
    if "calls" not in reference or "calls" not in other or len(reference["calls"]) != len(other["calls"]):
        return "-"
    pairs = list(zip(reference["calls"], other["calls"], strict=True))
    if any(a[0] != b[0] for a, b in pairs):
        return "- (prompts differ)"
    return f"{sum(a[1] == b[1] for a, b in pairs)} / {len(pairs)}"


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def report(results: dict[str, Any]) -> str:
    """The Markdown tables of one run."""
    lines = []
    regen = results["regeneration"]
    if regen:
        lines += [
            "### Regeneration (greedy, first reply)",
            "",
            "| back end | dtype | load s | generate s | replies | tokens | tokens/s | replies equal to hf |",
            "|---|---|---|---|---|---|---|---|",
        ]
    for label, r in regen.items():
        backend, _, dtype = label.partition(" ")
        if "error" in r:
            lines.append(f"| {backend} | {dtype or 'float32'} | failed: {r['error'].splitlines()[-1]} |||||| ")
            continue
        lines.append(
            f"| {backend} | {dtype or 'float32'} | {fmt(r['load_s'])} | {fmt(r['generate_s'])} | "
            f"{r['replies']} | {r['tokens']} | {fmt(r['tokens_per_s'])} | "
            f"{equal_replies(regen.get('hf', {}), r) if label != 'hf' else '(reference)'} |"
        )
    keys = (
        "tau",
        "per_position_acceptance",
        "lossless_fraction",
        "identical_fraction",
        "tokens_per_s_plain",
        "tokens_per_s_spec",
        "speedup",
        "tokens_per_s_plain_batched",
        "tokens_per_s_spec_batched",
        "speedup_batched",
        "tau_ngram",
    )
    evals = results.get("evaluation", {})
    if evals:
        lines += [
            "",
            "### Evaluation (stages/evaluate.py, same draft and prompts)",
            "",
            "| metric | " + " | ".join(evals) + " |",
            "|---" * (len(evals) + 1) + "|",
        ]
        for key in (*keys, "wall_s", "returncode"):
            row = []
            for r in evals.values():
                value = r.get(key) if key in ("wall_s", "returncode") else r.get("metrics", {}).get(key)
                row.append(", ".join(fmt(v, 3) for v in value) if isinstance(value, list) else fmt(value, 3))
            if any(v != "-" for v in row):
                lines.append(f"| {key} | " + " | ".join(row) + " |")
        lines += [f"- {label}: {r['error'].splitlines()[-1]}" for label, r in evals.items() if "error" in r]
    extracts = results.get("extraction", {})
    if extracts:
        lines += [
            "",
            "### Extraction (stages/extract.py, bf16 files)",
            "",
            "| back end | compute dtype | rows | tokens | seconds | tokens/s | wall s |",
            "|---|---|---|---|---|---|---|",
        ]
        for label, r in extracts.items():
            backend, _, dtype = label.partition(" ")
            m = r.get("metrics", {})
            lines.append(
                f"| {backend} | {dtype or 'float32'} | {fmt(m.get('rows'))} | {fmt(m.get('tokens'))} | "
                f"{fmt(m.get('seconds'))} | {fmt(m.get('tokens_per_s'))} | {fmt(r['wall_s'])} |"
            )
        lines += [f"- {label}: {r['error'].splitlines()[-1]}" for label, r in extracts.items() if "error" in r]
    return "\n".join(lines)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--repo",
        type=Path,
        required=True,
        help="pipeline repo after `dvc repro train` (models/verifier, data/prepared, models/draft)",
    )
    parser.add_argument("--out", type=Path, required=True, help="JSON file for every measured number")
    parser.add_argument("--conversations", type=int, default=128, help="conversations to regenerate")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="per regenerated reply and per evaluation")
    parser.add_argument("--max-len", type=int, default=512, help="prepare.max_len of the regeneration")
    parser.add_argument("--batch-size", type=int, default=64, help="prepare.regenerate_batch_size (both back ends)")
    parser.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts for evaluate")
    parser.add_argument("--skip-regeneration", action="store_true", help="skip (a), the regeneration runs")
    parser.add_argument("--skip-eval", action="store_true", help="skip (b), the evaluate stage runs")
    parser.add_argument("--skip-extract", action="store_true", help="skip (c), the extract stage runs")
    # internal: one regeneration measurement, in its own interpreter
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", choices=("hf", "vllm"), help=argparse.SUPPRESS)
    parser.add_argument("--dtype", choices=DTYPES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.repo = args.repo.resolve()
    if args.worker:
        args.out.write_text(json.dumps(regeneration_worker(args)))
        return 0
    needed = ["models/verifier", "params.yaml"]
    needed += [] if args.skip_eval and args.skip_extract else ["data/prepared"]
    needed += [] if args.skip_eval else ["models/draft"]
    for path in needed:
        if not (args.repo / path).exists():
            parser.error(f"--repo {args.repo}: no {path} (run `dvc repro train` there first)")

    started = time.perf_counter()
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor()},
        "args": {k: str(v) for k, v in vars(args).items() if k not in ("worker", "backend", "dtype")},
        "regeneration": {},
    }
    if not args.skip_regeneration:
        log(f"regeneration: hf, {args.conversations} conversations x {args.max_new_tokens} tokens")
        results["regeneration"]["hf"] = run_worker(args, "hf", None)
        for dtype in DTYPES:
            log(f"regeneration: vllm {dtype}")
            results["regeneration"][f"vllm {dtype}"] = run_worker(args, "vllm", dtype)
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_eval:
            results["evaluation"] = evaluation(args, Path(tmp))
        if not args.skip_extract:
            results["extraction"] = extraction(args, Path(tmp))
    results["wall_s"] = round(time.perf_counter() - started, 1)
    table = report(results)
    print(table)
    print(f"\n(total wall time {results['wall_s']:.0f} s on {os.cpu_count()} CPUs)")
    results["table"] = table
    args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
