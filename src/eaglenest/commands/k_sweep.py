"""``eaglenest k-sweep``: K, the drafts proposed per verify step, chosen by measurement for this draft.

At low acceptance a smaller K can serve faster: a rejected draft token still costs its share of the verify step
and of drafting. Run in a checkout whose pipeline is up to date::

    eaglenest k-sweep [--ks 1 2 3] [--repeats 2]

Per headline set of ``params.yaml``, the first ``evaluate.timed_prompts`` turns are decoded alone, as
``evaluate`` times them (after a warm-up, same engine arguments), by the plain engine, the draft (vLLM's EAGLE-3)
and vLLM's n-gram drafting (``evaluate``'s window) at each K. At each K the three engines take turns prompt by
prompt (the plain engine is timed again at each K), so a speed-up divides seconds measured moments apart. Every
engine runs in its own processes: vLLM's CPU build cannot start a fourth engine in one process. With
``--repeats N`` the whole round runs N times, so the spread between rounds shows the timing noise.

It writes ``metrics/k_sweep.json`` (kept in git, not a declared metric): per round, K and set, tokens/s (the plain
engine's too), the speed-up over the plain engine timed beside it with its 95% interval over the turns, and tau;
per set the K with the best mean speed-up, for the draft and for n-gram; and ``serve_k``, the K with the best mean
speed-up over the headline sets, with the draft's fingerprint. ``eaglenest serve`` serves that draft at
``serve_k`` unless told otherwise (:func:`recorded_k`); a retrained draft has another fingerprint and is served
at its own K.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.commands.command import Command
from eaglenest.core.atomic import atomic_write_json
from eaglenest.core.errors import EaglenestError

K_SWEEP_FILE = Path("metrics/k_sweep.json")
BOOTSTRAP_SAMPLES = 2000


@dataclass
class TimedTurns:
    """The headline sets of ``params.yaml`` and the first turn of each of their first ``timed_prompts``
    conversations (what evaluate times on single-turn sets), with the engine arguments they need.

    Attributes:
        params: The evaluate params.
        sets: The headline sets.
        prompts: Set name -> rendered prompts (token ids).
        trained_k: The draft's own speculative_tokens.
        common: The ``vllm.LLM`` arguments every engine shares, sized for the largest K asked for.
    """

    params: Any
    sets: list[Any]
    prompts: dict[str, list[list[int]]]
    trained_k: int
    common: dict[str, Any]


@dataclass(frozen=True)
class PipelinePaths:
    """The pipeline's folders a single-stream measurement reads (dvc.yaml's defaults)."""

    params: Path = Path("params.yaml")
    verifier: Path = Path("models/verifier")
    draft: Path = Path("models/draft")
    prepared: Path = Path("data/prepared")


def timed_turns(paths: PipelinePaths, max_k: int | None = None) -> TimedTurns:
    """The timed turns of the checkout's headline sets, the engines sized for K up to ``max_k``."""
    from eaglenest.artifacts.draft import draft_tokens
    from eaglenest.artifacts.verifier import load_tokenizer, load_verifier_info
    from eaglenest.core.params import load_sections
    from eaglenest.stages.evaluate.params import EvaluateStageParams
    from eaglenest.stages.evaluate.sets import load_eval_sets
    from eaglenest.stages.evaluate.vllm import build_evaluate_llm_kwargs

    params = load_sections(paths.params, EvaluateStageParams).evaluate
    trained_k = draft_tokens(paths.draft, "--draft")  # one line before a minute of engine start
    tokenizer = load_tokenizer(paths.verifier)
    sets = [s for s in load_eval_sets(params.sets, paths.prepared, tokenizer) if s.params.headline]
    if not sets:
        raise EaglenestError(f"{paths.params}: evaluate.sets has no headline set (headline: true) to time")
    if params.timed_prompts == 0:
        raise EaglenestError(f"{paths.params}: evaluate.timed_prompts = 0: the sweep times turns; set it to 1 or more")
    prompts = {s.name: [s.render(c, 0, [], tokenizer) for c in s.conversations[:params.timed_prompts]] for s in sets}
    info, model_dir = load_verifier_info(paths.verifier)
    longest = max(len(p) for ps in prompts.values() for p in ps)
    k = max(max_k or 0, params.num_speculative_tokens or trained_k)
    common = build_evaluate_llm_kwargs(params, info, model_dir,
                                       context_tokens=longest + max(s.params.max_new_tokens for s in sets) + k + 1)
    return TimedTurns(params, sets, prompts, trained_k, common)


def start_engine(turns: TimedTurns, extra: dict[str, Any], what: str) -> Any:
    """One engine with the timed turns' arguments (``extra``: a speculative engine's), warmed up on every set.

    Each engine runs in its own processes: vLLM's CPU build cannot start a fourth engine in one process (its
    kernel overrides are registered again on the wrappers of the last: AttributeError), and a sweep starts more.
    """
    from eaglenest.core.vllm_support import create_llm
    from eaglenest.stages.evaluate.vllm import PARAM, decode_alone

    llm = create_llm({**turns.common, **extra}, PARAM, what=what)
    for s in turns.sets:
        decode_alone(llm, turns.prompts[s.name][:1], _sampling(turns, s))  # first forwards allocate, pick kernels
    return llm


def time_together(turns: TimedTurns, engines: dict[str, tuple[Any, int]]) -> dict[str, dict[str, Any]]:
    """Every headline set's timed turns on each engine, each turn alone, the engines taking turns prompt by prompt
    (:func:`~eaglenest.stages.evaluate.vllm.time_interleaved`, as evaluate times them).

    Args:
        turns: The timed turns.
        engines: Name -> (engine, its K; 0 for the plain engine).

    Returns:
        Per engine and set: ``turns`` ([tokens, seconds] per turn), their totals and tokens/s; for a speculative
        engine also the verify steps that had a draft and tau over them (every step, for EAGLE-3; n-gram drafts
        only on a match).
    """
    from eaglenest.stages.evaluate.acceptance import total
    from eaglenest.stages.evaluate.vllm import request_acceptance, time_interleaved

    result: dict[str, dict[str, Any]] = {name: {} for name in engines}
    for s in turns.sets:
        timed = time_interleaved({name: llm for name, (llm, _) in engines.items()}, turns.prompts[s.name],
                                 _sampling(turns, s))
        for name, (_, k) in engines.items():
            per_turn = [[len(output.outputs[0].token_ids), round(seconds, 4)] for output, seconds in timed[name]]
            tokens = sum(t for t, _ in per_turn)
            seconds = sum(elapsed for _, elapsed in timed[name])
            entry: dict[str, Any] = {"tokens": tokens, "seconds": round(seconds, 3),
                                     "tokens_per_s": round(tokens / seconds, 2), "turns": per_turn}
            counts = [request_acceptance(output, k) for output, _ in timed[name]] if k else []
            if counts and all(c is not None for c in counts):
                summed = total(counts, k)  # type: ignore[arg-type]
                entry |= {"steps_with_draft": summed.steps,
                          "tau_when_drafted": round(1 + summed.accepted / max(summed.steps, 1), 3)}
            result[name][s.name] = entry
    return result


def _sampling(turns: TimedTurns, eval_set: Any) -> Any:
    from eaglenest.stages.evaluate.vllm import sampling_params

    return sampling_params(eval_set.params.max_new_tokens, eval_set.params.temperature, turns.params.seed)


def add_speedups(run: dict[str, Any], plain: dict[str, Any], seed: int = 0) -> None:
    """Each set's speed-up over the plain engine's tokens/s timed beside it, with its 95% interval over turns
    (turn i of both engines is the same prompt, so turns are resampled in pairs)."""
    import numpy as np

    from eaglenest.core.bootstrap import bootstrap, speedup_statistic

    for name, entry in run.items():
        entry["speedup"] = round(entry["tokens_per_s"] / plain[name]["tokens_per_s"], 3)
        pairs = np.array([spec + base for spec, base in zip(entry["turns"], plain[name]["turns"], strict=True)],
                         dtype=np.float64)  # [turns, 4]: spec tokens, spec s, plain tokens, plain s
        entry["speedup_ci95"] = round(bootstrap(pairs, speedup_statistic, BOOTSTRAP_SAMPLES, seed).half_width, 3)


def best_ks(rounds: list[dict[str, Any]], set_names: list[str], ks: list[int]) -> tuple[dict[str, Any], int]:
    """Per set and drafter, the K with the best mean speed-up over rounds; and the K to serve the draft at.

    Returns:
        ``({set: {"draft"|"ngram": {k, mean_speedup, mean_speedup_per_k}}}, serve_k)``; serve_k has the best
        mean over the sets of the draft's mean speed-ups (ties: the smaller K, the cheaper verify step).
    """
    best: dict[str, Any] = {}
    means: dict[str, dict[int, float]] = {}
    for name in set_names:
        best[name] = {}
        for drafter in ("draft", "ngram"):
            per_k = {k: statistics.mean(r[drafter][str(k)][name]["speedup"] for r in rounds) for k in ks}
            k_best = max(ks, key=lambda k, per_k=per_k: (per_k[k], -k))
            best[name][drafter] = {"k": k_best, "mean_speedup": round(per_k[k_best], 3),
                                   "mean_speedup_per_k": {str(k): round(v, 3) for k, v in per_k.items()}}
            if drafter == "draft":
                means[name] = per_k
    over_sets = {k: statistics.mean(means[name][k] for name in set_names) for k in ks}
    return best, max(ks, key=lambda k: (over_sets[k], -k))


def draft_fingerprint(draft_dir: Path) -> str:
    """sha256 of the draft's config.json and weights: what a recorded K was measured on."""
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        with open(draft_dir / name, "rb") as f:
            for block in iter(lambda f=f: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def run_sweep(paths: PipelinePaths, ks: list[int] | None, repeats: int, out: Path) -> dict[str, Any]:
    """The sweep: at each K, plain, the draft and n-gram timed together; ``repeats`` rounds; written to ``out``."""
    from eaglenest.artifacts.draft import draft_algorithm, vllm_speculative_config
    from eaglenest.stages.evaluate.vllm import close_engine, ngram_config, speculative_engine_kwargs

    if repeats < 1:
        raise EaglenestError(f"--repeats {repeats}: must be at least 1")
    if ks and min(ks) < 1:
        raise EaglenestError(f"--ks {' '.join(map(str, ks))}: every K must be at least 1")
    # sized for the largest K asked for; the default Ks stop at the draft's own, which timed_turns covers
    turns = timed_turns(paths, max_k=max(ks) if ks else None)
    ks = sorted(set(ks or range(1, turns.trained_k + 1)))
    rounds = []
    for round_number in range(repeats):
        plain = start_engine(turns, {}, "the verifier")
        measured: dict[str, dict[str, Any]] = {"plain": {}, "draft": {}, "ngram": {}}
        for k in ks:
            draft = vllm_speculative_config(paths.draft, k)
            engines = {"draft": (start_engine(turns, speculative_engine_kwargs(draft), f"the draft, K={k}"), k),
                       "ngram": (start_engine(turns, speculative_engine_kwargs(ngram_config(turns.params, k)[0]),
                                              f"n-gram drafting, K={k}"), k)}
            # the plain engine is timed again beside each K's two: every speed-up divides neighbouring seconds
            for name, entry in time_together(turns, {"plain": (plain, 0), **engines}).items():
                measured[name][str(k)] = entry
            for drafter, (llm, _) in engines.items():
                close_engine(llm)
                add_speedups(measured[drafter][str(k)], measured["plain"][str(k)], turns.params.seed)
                print(f"round {round_number}, {drafter} K={k}: " + ", ".join(
                    f"{n} x{e['speedup']} ± {e['speedup_ci95']}" for n, e in measured[drafter][str(k)].items()),
                    flush=True)
        close_engine(plain)
        rounds.append(measured)
    names = [s.name for s in turns.sets]
    best, serve_k = best_ks(rounds, names, ks)
    result = {"draft": {"path": str(paths.draft), "sha256": draft_fingerprint(paths.draft),
                        "algorithm": draft_algorithm(paths.draft, "the draft"), "trained_k": turns.trained_k},
              "commit": short_commit(), "timed_prompts": turns.params.timed_prompts,
              "ngram_window": list(ngram_config(turns.params, 1)[1]), "ks": ks, "repeats": repeats,
              "serve_k": serve_k, "best": best, "rounds": rounds}
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, result)
    return result


def summary_lines(result: dict[str, Any]) -> list[str]:
    """What the sweep found, one line per set and the K serve will use."""
    lines = []
    for name, entry in result["best"].items():
        per_k = entry["draft"]["mean_speedup_per_k"]
        ngram = entry["ngram"]["mean_speedup_per_k"]
        lines.append(f"{name}: draft " + ", ".join(f"K={k} x{v}" for k, v in per_k.items()) + "; n-gram "
                     + ", ".join(f"K={k} x{v}" for k, v in ngram.items()) + f"; best K {entry['draft']['k']}")
    lines.append(f"serve_k {result['serve_k']} (the draft's own K is {result['draft']['trained_k']}): "
                 "`eaglenest serve` uses it for this draft")
    return lines


def recorded_k(draft_dir: Path, sweep_file: Path) -> tuple[int | None, str]:
    """The K a sweep measured fastest for this very draft, or None; and why, in words for the user.

    Raises:
        EaglenestError: the sweep file exists but is not a sweep's output (one line naming it).
    """
    if not sweep_file.is_file():
        return None, f"no {sweep_file} (eaglenest k-sweep measures the fastest K)"
    try:
        record = json.loads(sweep_file.read_text())
        serve_k, measured_on = int(record["serve_k"]), str(record["draft"]["sha256"])
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise EaglenestError(f"{sweep_file}: not an `eaglenest k-sweep` result ({type(err).__name__}: {err}); "
                             "rerun `eaglenest k-sweep` or pass --num-speculative-tokens K") from None
    if serve_k < 1:
        raise EaglenestError(f"{sweep_file}: serve_k is {serve_k}; rerun `eaglenest k-sweep`")
    if measured_on != draft_fingerprint(draft_dir):
        return None, f"{sweep_file} was measured on another draft (rerun `eaglenest k-sweep` for this one)"
    return serve_k, f"the fastest K measured for this draft ({sweep_file}, commit {record.get('commit', '?')})"


def short_commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ks", nargs="+", type=int, default=None, metavar="K",
                        help="the Ks to time (default: 1 up to the draft's own)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the whole sweep (default: 1)")
    parser.add_argument("--out", default=str(K_SWEEP_FILE), help=f"the result (default: {K_SWEEP_FILE})")
    parser.add_argument("--params", default="params.yaml", help="the pipeline's params (default: params.yaml)")
    parser.add_argument("--verifier", default="models/verifier", help="the verifier stage's output folder")
    parser.add_argument("--draft", default="models/draft", help="the train stage's draft checkpoint")
    parser.add_argument("--prepared", default="data/prepared", help="the prepare stage's dataset (val sets)")


def _run(args: argparse.Namespace) -> int:
    paths = PipelinePaths(Path(args.params), Path(args.verifier), Path(args.draft), Path(args.prepared))
    print("\n".join(summary_lines(run_sweep(paths, args.ks, args.repeats, Path(args.out)))))
    return 0


COMMAND = Command(
    "k-sweep", help="time the draft and vLLM's n-gram drafting at each K, single-stream on the headline sets; "
    "record the fastest K for `eaglenest serve`", add_arguments=_add_arguments, run=_run)
