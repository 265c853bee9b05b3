"""The n-gram baseline's lookup window: vLLM's ``ngram`` drafting at the draft's K with each window, timed the
way ``evaluate`` times it.

Run in a checkout whose pipeline is up to date, with the project's interpreter on PATH::

    .venv/bin/python bench/ngram_window.py --windows 5:5 3:5 2:4 1:3 1:5

Per headline set of ``params.yaml``, the first ``evaluate.timed_prompts`` turns are decoded alone by the plain
engine, then by one n-gram engine per window (``prompt_lookup_min:prompt_lookup_max``), each after a warm-up, in
this one process. Prints and writes ``bench/results/ngram_window.json``: per window and set, tokens/s, the
speed-up over the plain engine of the same run, and the share of verify steps where n-gram proposed a draft
and tau conditional on that. Single-stream tokens/s on a shared 2-core machine move by about a tenth between
engine starts: a window is better only by more than that.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from eaglenest.artifacts.draft import draft_tokens
from eaglenest.artifacts.verifier import load_tokenizer, load_verifier_info
from eaglenest.core.atomic import atomic_write_json
from eaglenest.core.params import load_params
from eaglenest.core.vllm_support import create_llm
from eaglenest.stages.evaluate.acceptance import total
from eaglenest.stages.evaluate.sets import load_eval_sets
from eaglenest.stages.evaluate.vllm import (
    PARAM,
    _close,
    _generate,
    _timed_one_by_one,
    build_evaluate_llm_kwargs,
    request_acceptance,
)

OUT = Path("bench/results/ngram_window.json")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", nargs="+", default=["5:5", "3:5", "2:4", "1:3"], metavar="MIN:MAX")
    args = parser.parse_args()
    windows = [tuple(int(v) for v in w.split(":")) for w in args.windows]
    params = load_params(Path("params.yaml")).evaluate
    verifier_dir, draft_dir = Path("models/verifier"), Path("models/draft")
    tokenizer = load_tokenizer(verifier_dir)
    sets = [s for s in load_eval_sets(params.sets, Path("data/prepared"), tokenizer) if s.params.headline]
    # the first turn of each of the first timed_prompts conversations: what evaluate times on single-turn sets
    prompts = {s.name: [s.render(c, 0, [], tokenizer) for c in s.conversations[:params.timed_prompts]] for s in sets}
    k = params.num_speculative_tokens or draft_tokens(draft_dir, "bench: the draft")
    info, model_dir = load_verifier_info(verifier_dir)
    longest = max(len(p) for ps in prompts.values() for p in ps)
    common = build_evaluate_llm_kwargs(params, info, model_dir,
                                       context_tokens=longest + max(s.params.max_new_tokens for s in sets) + k + 1)

    def run_engine(extra: dict, what: str) -> dict:
        llm = create_llm({**common, **extra}, PARAM, what=what)
        from vllm import SamplingParams

        result = {}
        for s in sets:
            sampling = SamplingParams(max_tokens=s.params.max_new_tokens, temperature=s.params.temperature,
                                      seed=params.seed)
            _generate(llm, [prompts[s.name][0]], sampling)  # warm-up
            timed = _timed_one_by_one(llm, prompts[s.name], sampling)  # evaluate's own single-stream timing
            tokens = sum(len(output.outputs[0].token_ids) for output, _ in timed)
            seconds = sum(elapsed for _, elapsed in timed)
            entry = {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 2)}
            counts = [request_acceptance(output, k) for output, _ in timed]
            if all(c is not None for c in counts):
                summed = total(counts, k)  # type: ignore[arg-type]
                entry |= {"steps_with_draft": summed.steps,
                          "tau_when_drafted": round(1 + summed.accepted / max(summed.steps, 1), 3)}
            result[s.name] = entry
        _close(llm)
        return result

    plain = run_engine({}, "the verifier")
    runs = {}
    for low, high in windows:
        config = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": low, "prompt_lookup_max": high}
        runs[f"{low}:{high}"] = run_engine({"disable_log_stats": False, "per_request_spec_decode_metrics": "summary",
                                            "speculative_config": config}, f"n-gram {low}:{high}")
        for name, entry in runs[f"{low}:{high}"].items():
            entry["speedup"] = round(entry["tokens_per_s"] / plain[name]["tokens_per_s"], 3)
        print(f"window {low}:{high}: " + ", ".join(f"{n} x{e['speedup']}" for n, e in runs[f"{low}:{high}"].items()),
              flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(OUT, {"command": " ".join(["bench/ngram_window.py", *sys.argv[1:]]), "commit": commit,
                            "num_speculative_tokens": k, "timed_prompts": params.timed_prompts, "plain": plain,
                            "windows": runs})
    print(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
