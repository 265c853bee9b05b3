"""Run by tests/core/drafter/test_drafter_engines.py in a process of its own (vLLM reads its environment once per
process): real vLLM engines on the tiny verifier and draft, in float32, and what they decoded and drafted.

    python tests/core/drafter/engines.py VERIFIER DRAFT OUT.json

Writes, for each drafter setting, the outputs, the drafter's counts, its traced proposals, and for a sample of the
draft's traced proposals the proposal a fresh engine makes on the same prefix.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

# Prompts of which the random verifier's outputs repeat (suffix decoding matches) and others, of several lengths;
# each request its own length of output, so the batch shrinks step by step (the schedule's K changes mid-request).
PROMPTS = [[5 + (i * 7 + j * 3) % 50 for j in range(20 + i)] for i in range(6)] + [[10, 11, 12, 13, 14] * 6]
SCHEDULE = [[1, 2, 4], [3, 4, 0]]  # K 4 for one or two requests in flight, none for three or four
THRESHOLD = 2.5  # a suffix continuation's score to be proposed: the random verifier's repeats reach it, not always


def forgetting(on: bool) -> None:
    """The control: where on, a request's kept positions are dropped but for its last step's (a drafter that skips
    the draft's forward without catching up); the engines run in this process, so the class is theirs."""
    from eaglenest.core.drafter import runner

    if not hasattr(runner.Unseen, "_joined"):
        runner.Unseen._joined = runner.Unseen.joined
    runner.Unseen.joined = (
        (lambda self: tuple(part[-1] for part in (self.token_ids, self.positions, self.hidden, self.slots)))
        if on
        else runner.Unseen._joined
    )


def engine(verifier: str, **kwargs):
    from vllm import LLM

    return LLM(
        model=verifier,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        enable_prefix_caching=False,
        seed=0,
        max_num_seqs=4,
        disable_log_stats=False,
        **kwargs,
    )


def accepted(llm) -> dict:
    """vLLM's own spec-decode counters of the engine so far."""
    return {
        metric.name.split(":")[-1]: metric.value
        for metric in llm.get_metrics()
        if metric.name.startswith("vllm:spec_decode_num_") and hasattr(metric, "value")
    }


def stop(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def main() -> None:
    from vllm import SamplingParams

    from eaglenest.core.drafter.config import CONFIG_KEY, DrafterConfig, SuffixConfig, speculative_config
    from eaglenest.core.drafter.runner import TRACE_ENV, counts

    verifier, draft, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    requests = [{"prompt_token_ids": p} for p in PROMPTS]
    lengths = [SamplingParams(max_tokens=20 + 6 * i, temperature=0.0, ignore_eos=True) for i in range(len(PROMPTS))]
    results: dict = {"prompts": PROMPTS}

    llm = engine(verifier)
    results["plain"] = [list(o.outputs[0].token_ids) for o in llm.generate(requests, lengths, use_tqdm=False)]
    stop(llm)

    settings = {
        "draft_unscheduled": DrafterConfig(draft_k=3),
        "draft": DrafterConfig(draft_k=3),
        "hybrid": DrafterConfig(draft_k=3, suffix=SuffixConfig(k=4, threshold=THRESHOLD)),
        "hybrid_retire": DrafterConfig(draft_k=3, suffix=SuffixConfig(k=4, threshold=THRESHOLD), at_zero="retire"),
        # the check's control: the hybrid with the positions it skipped never fed to the draft (its last step's only)
        "hybrid_forgetting": DrafterConfig(draft_k=3, suffix=SuffixConfig(k=4, threshold=THRESHOLD)),
    }
    for name, config in settings.items():
        forgetting(name == "hybrid_forgetting")
        trace = out.parent / f"trace-{name}.jsonl"
        trace.unlink(missing_ok=True)
        os.environ[TRACE_ENV] = str(trace)
        llm = engine(
            verifier,
            speculative_config=speculative_config(draft, config, None if name == "draft_unscheduled" else SCHEDULE),
            additional_config={CONFIG_KEY: config.model_dump()},
        )
        outputs = llm.generate(requests, lengths, use_tqdm=False)
        index = {o.request_id: i for i, o in enumerate(outputs)}
        traced = [json.loads(line) for line in trace.read_text().splitlines()] if trace.exists() else []
        for line in traced:  # vLLM's internal request ids carry a suffix after the caller's
            line["prompt"] = index[line.pop("req").split("-")[0]]
        results[name] = {
            "outputs": [list(o.outputs[0].token_ids) for o in outputs],
            "counts": llm.collective_rpc(counts)[0],
            "accepted": accepted(llm),
            "traced": traced,
        }
        stop(llm)
    del os.environ[TRACE_ENV]
    forgetting(False)

    # vLLM's own EAGLE-3 on the same draft, alone, at the draft's K: what the drafter's draft-alone setting must equal
    llm = engine(verifier, speculative_config={"method": "eagle3", "model": draft, "num_speculative_tokens": 3})
    outputs = llm.generate(requests, lengths, use_tqdm=False)
    results["vllm_eagle3"] = {"outputs": [list(o.outputs[0].token_ids) for o in outputs], "accepted": accepted(llm)}
    stop(llm)

    # a fresh engine's first proposal on each traced draft proposal's prefix
    fresh_config = DrafterConfig(draft_k=3)
    trace = out.parent / "trace-fresh.jsonl"
    os.environ[TRACE_ENV] = str(trace)
    llm = engine(
        verifier,
        speculative_config=speculative_config(draft, fresh_config),
        additional_config={CONFIG_KEY: fresh_config.model_dump()},
    )
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for name in settings:
        checks = []
        for line in (t for t in results[name]["traced"] if t["source"] == "draft"):
            sequence = PROMPTS[line["prompt"]] + results[name]["outputs"][line["prompt"]]
            if line["num_tokens"] > len(sequence):
                continue  # a last step past max_tokens: its proposal follows tokens the output does not keep
            trace.write_text("")
            # the prefix up to the proposal's first position: its prefill samples the token the proposal follows
            llm.generate([{"prompt_token_ids": sequence[: line["num_tokens"] - 1]}], one, use_tqdm=False)
            fresh = [json.loads(x) for x in trace.read_text().splitlines()]
            checks.append({**line, "fresh": fresh[0]["tokens"] if fresh else None})
        results[name]["fresh"] = checks
    stop(llm)
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
