"""The n-gram baseline's lookup window: vLLM's ``ngram`` drafting at the draft's K with each window, timed the
way ``evaluate`` times it.

Run in a checkout whose pipeline is up to date, with the project's interpreter on PATH::

    .venv/bin/python bench/ngram_window.py --windows 5:5 3:5 2:4 1:3 1:5

Per headline set of ``params.yaml``, the first ``k_sweep.timed_prompts`` turns are decoded alone by the plain
engine and by one n-gram engine per window (``prompt_lookup_min:prompt_lookup_max``), each after a warm-up, the
two taking turns prompt by prompt, as the k_sweep stage times them (:mod:`eaglenest.stages.k_sweep`).
Prints and writes ``bench/results/ngram_window.json``:
per window and set, tokens/s, the speed-up over the plain engine timed beside it, and the share of verify steps
where n-gram proposed a draft and tau conditional on that. Each window's speed-up divides seconds timed moments
apart, so the machine's drift between windows cancels out of it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eaglenest.artifacts.draft import draft_tokens
from eaglenest.artifacts.verifier import load_verifier_info
from eaglenest.commands.params_file import load_params
from eaglenest.core.atomic import atomic_write_json
from eaglenest.core.measure.engines import EngineBase, close_engine, requested_k, start_engine
from eaglenest.stages.k_sweep import KSweepPaths, short_commit, time_beside_plain, timed_turns

OUT = Path("bench/results/ngram_window.json")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", nargs="+", default=["5:5", "3:5", "2:4", "1:3"], metavar="MIN:MAX")
    args = parser.parse_args()
    windows = [tuple(int(v) for v in w.split(":")) for w in args.windows]
    params = load_params("params.yaml")
    paths = KSweepPaths(Path("models/verifier"), Path("data/prepared"), Path("models/draft"), OUT)
    k = requested_k(params.evaluate.num_speculative_tokens, draft_tokens(paths.draft, "models/draft"),
                    "evaluate.num_speculative_tokens")
    turns = timed_turns(params, paths, k)
    info, model_dir = load_verifier_info(paths.verifier)
    # no prefix cache: the plain engine is timed beside every window, each time with the prompts' prefill
    base = EngineBase(model_dir, info, params.evaluate.vllm, params.evaluate.seed, at_once=2)
    common = base.kwargs(turns.requests)
    plain, _ = start_engine(common, "bench/ngram_window.py", "the verifier", turns.warm_up, params.evaluate.seed,
                            turns.every_prompt)
    runs = {}
    for low, high in windows:
        config = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": low, "prompt_lookup_max": high}
        ngram, _ = start_engine(base.kwargs(turns.requests, speculative_config=config), "bench/ngram_window.py",
                                f"n-gram {low}:{high}", turns.warm_up, params.evaluate.seed, turns.every_prompt)
        # taking turns prompt by prompt with the plain engine
        runs[f"{low}:{high}"] = time_beside_plain(turns, plain, {"ngram": ngram}, params.evaluate,
                                                  f"window {low}:{high}")["ngram"]
        close_engine(ngram)
        print(f"window {low}:{high}: " + ", ".join(f"{n} x{e['speedup']}" for n, e in runs[f"{low}:{high}"].items()),
              flush=True)
    close_engine(plain)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(OUT, {"command": " ".join(["bench/ngram_window.py", *sys.argv[1:]]), "commit": short_commit(),
                            "num_speculative_tokens": k, "timed_prompts": params.k_sweep.timed_prompts,
                            "windows": runs})
    print(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
