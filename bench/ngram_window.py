"""The n-gram baseline's lookup window: vLLM's ``ngram`` drafting at the draft's K with each window, timed the
way ``evaluate`` times it.

Run in a checkout whose pipeline is up to date, with the project's interpreter on PATH::

    .venv/bin/python bench/ngram_window.py --windows 5:5 3:5 2:4 1:3 1:5

Per headline set of ``params.yaml``, the first ``evaluate.timed_prompts`` turns are decoded alone by the plain
engine and by one n-gram engine per window (``prompt_lookup_min:prompt_lookup_max``), each after a warm-up, in
its own processes, the two taking turns prompt by prompt. Prints and writes ``bench/results/ngram_window.json``:
per window and set, tokens/s, the speed-up over the plain engine timed beside it, and the share of verify steps
where n-gram proposed a draft and tau conditional on that. Each window's speed-up divides seconds timed moments
apart, so the machine's drift between windows cancels out of it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eaglenest.commands.k_sweep import (
    PipelinePaths,
    add_speedups,
    short_commit,
    start_engine,
    time_together,
    timed_turns,
)
from eaglenest.core.atomic import atomic_write_json
from eaglenest.stages.evaluate.vllm import close_engine, speculative_engine_kwargs

OUT = Path("bench/results/ngram_window.json")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", nargs="+", default=["5:5", "3:5", "2:4", "1:3"], metavar="MIN:MAX")
    args = parser.parse_args()
    windows = [tuple(int(v) for v in w.split(":")) for w in args.windows]
    turns = timed_turns(PipelinePaths())
    k = turns.params.num_speculative_tokens or turns.trained_k
    plain = start_engine(turns, {}, "the verifier")
    runs, plain_runs = {}, {}
    for low, high in windows:
        config = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": low, "prompt_lookup_max": high}
        ngram = start_engine(turns, speculative_engine_kwargs(config), f"n-gram {low}:{high}")
        measured = time_together(turns, {"plain": (plain, 0), "ngram": (ngram, k)})  # taking turns prompt by prompt
        close_engine(ngram)
        runs[f"{low}:{high}"], plain_runs[f"{low}:{high}"] = measured["ngram"], measured["plain"]
        add_speedups(runs[f"{low}:{high}"], plain_runs[f"{low}:{high}"])
        print(f"window {low}:{high}: " + ", ".join(f"{n} x{e['speedup']}" for n, e in runs[f"{low}:{high}"].items()),
              flush=True)
    close_engine(plain)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(OUT, {"command": " ".join(["bench/ngram_window.py", *sys.argv[1:]]), "commit": short_commit(),
                            "num_speculative_tokens": k, "timed_prompts": turns.params.timed_prompts,
                            "plain": plain_runs, "windows": runs})
    print(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
