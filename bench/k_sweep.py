"""K, the drafts proposed per verify step: the draft (vLLM's EAGLE-3) and n-gram drafting at each K, timed the
way ``evaluate`` times them. At low acceptance a smaller K can serve faster: a rejected draft token still costs
its share of the verify step and of drafting.

Run in a checkout whose pipeline is up to date, with the project's interpreter on PATH::

    .venv/bin/python bench/k_sweep.py [--ks 1 2 3] [--repeats 2]

Per headline set of ``params.yaml``, the first ``evaluate.timed_prompts`` turns are decoded alone by the plain
engine, then by an EAGLE-3 and an n-gram engine (vLLM's default window) per K, each in its own processes; with
``--repeats`` N, the whole round runs N times, so the spread between rounds shows the timing noise. Prints and
writes ``bench/results/k_sweep.json``: per round, K and set, tokens/s, speed-up over that round's plain engine,
and tau; then per set the K with the best mean speed-up, for the draft and for n-gram.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from single_stream import add_speedups, short_commit, speculative, time_engine, timed_turns

from eaglenest.core.atomic import atomic_write_json
from eaglenest.stages.evaluate.vllm import ngram_config

OUT = Path("bench/results/k_sweep.json")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", nargs="+", type=int, default=None, help="default: 1 up to the draft's depth")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    turns = timed_turns()
    ks = args.ks or list(range(1, turns.trained_k + 1))
    turns = timed_turns(max_k=max(ks))
    rounds = []
    for round_number in range(args.repeats):
        plain = time_engine(turns, {}, "the verifier", 1)
        runs: dict[str, dict] = {"eagle3": {}, "ngram": {}}
        for k in ks:
            draft = {"method": "eagle3", "model": "models/draft", "num_speculative_tokens": k}
            runs["eagle3"][str(k)] = time_engine(turns, speculative(draft), f"the EAGLE-3 draft, K={k}", k)
            ngram, _ = ngram_config(turns.params, k)
            runs["ngram"][str(k)] = time_engine(turns, speculative(ngram), f"n-gram drafting, K={k}", k)
            for method in runs:
                add_speedups(runs[method][str(k)], plain)
                print(f"round {round_number}, {method} K={k}: " + ", ".join(
                    f"{n} x{e['speedup']}" for n, e in runs[method][str(k)].items()), flush=True)
        rounds.append({"plain": plain, **runs})
    best = {}
    for s in turns.sets:
        best[s.name] = {}
        for method in ("eagle3", "ngram"):
            means = {k: statistics.mean(r[method][str(k)][s.name]["speedup"] for r in rounds) for k in ks}
            k_best = max(means, key=means.get)
            best[s.name][method] = {"k": k_best, "mean_speedup": round(means[k_best], 3),
                                    "mean_speedup_per_k": {str(k): round(v, 3) for k, v in means.items()}}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(OUT, {"command": " ".join(["bench/k_sweep.py", *sys.argv[1:]]), "commit": short_commit(),
                            "timed_prompts": turns.params.timed_prompts, "ks": ks, "rounds": rounds, "best": best})
    print(json.dumps(best, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
