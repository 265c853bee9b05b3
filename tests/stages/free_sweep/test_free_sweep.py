"""The free_sweep stage: n-gram drafting replayed with vLLM's own proposer, the best window per K timed beside the
plain engine (engines that differ only in speculative_config), the fastest recorded, and evaluate and serve running
what it recorded. Fast: the replay, the choice and the record, on engines that are only names; slow: the real stage
in the shared pipeline."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

import eaglenest.stages.free_sweep as ngram_stage
from eaglenest.artifacts.free_record import measured_ngram, measured_suffix, read_free_record
from eaglenest.commands import cli
from eaglenest.commands.params_file import parse_params
from eaglenest.core.errors import EaglenestError, ParamsError
from eaglenest.core.measure import engines, single_stream
from eaglenest.core.measure.beside_plain import TimedTurns
from eaglenest.core.measure.engines import DRAFTING_KEYS, NgramSetting, SuffixSetting
from eaglenest.stages.free_sweep import FreeSweepPaths, sweep, tuning_turns
from eaglenest.stages.free_sweep.replay import (
    Replayed,
    best_suffix_per_k,
    best_window_per_k,
    replay,
    replay_suffix,
    suffix_cache_class,
    suffix_settings,
    vllm_proposer,
    windows,
)
from tests.conftest import requires_vllm
from tests.fixtures.pipeline import SharedPipeline, pipeline_until_prepare


def lookup(tokens: np.ndarray, low: int, high: int, max_model_len: int, k: int) -> np.ndarray:
    """A proposer of the same contract as vLLM's: the longest suffix within the window that occurred earlier, its
    earliest occurrence, the k tokens after it."""
    sequence = list(tokens)
    for n in range(min(high, len(sequence) - 1), low - 1, -1):
        suffix = sequence[-n:]
        for start in range(len(sequence) - n):
            if sequence[start : start + n] == suffix:
                return np.array(sequence[start + n : start + n + k], dtype=tokens.dtype)
    return np.empty(0, dtype=tokens.dtype)


PROMPT = [1, 2, 3, 4, 5, 1, 2, 3]
OUTPUT = [4, 5, 1, 2, 3, 4, 9]


def test_a_replay_counts_the_verify_steps_a_greedy_run_takes():
    # prefill emits 4; [2 3 4] proposes 5 1 2, all accepted, 3 emitted with them; [1 2 3] proposes 4 5 1: 4 accepted,
    # 9 emitted: 3 forwards where plain decoding takes 7
    assert replay(lookup, PROMPT, OUTPUT, NgramSetting(1, 3, 3)) == Replayed(steps=3, drafted=6, accepted=4)
    # K = 1: one token a step at most
    assert replay(lookup, PROMPT, OUTPUT, NgramSetting(1, 3, 1)).steps == 4
    # a window longer than any repeat proposes nothing: one step per token, as plain decoding
    assert replay(lookup, [7, 8], [9, 10, 11], NgramSetting(4, 5, 3)) == Replayed(steps=3)
    assert replay(lookup, PROMPT, [], NgramSetting(1, 3, 3)) == Replayed()


@requires_vllm
def test_the_replay_uses_vllms_own_proposer():
    propose = vllm_proposer()
    for setting in (NgramSetting(1, 3, 3), NgramSetting(1, 3, 1), NgramSetting(2, 2, 4)):
        assert replay(propose, PROMPT, OUTPUT, setting) == replay(lookup, PROMPT, OUTPUT, setting)


def test_every_window_is_replayed_and_the_fewest_steps_win_per_k():
    assert windows(1, 3) == [(1, 1), (1, 2), (1, 3), (2, 2), (2, 3), (3, 3)]
    counts = {
        NgramSetting(1, 3, 2): Replayed(40),
        NgramSetting(2, 3, 2): Replayed(40),
        NgramSetting(3, 3, 2): Replayed(41),
        NgramSetting(1, 3, 4): Replayed(33),
        NgramSetting(2, 4, 4): Replayed(35),
    }
    # a tie goes to the narrower window
    assert best_window_per_k(counts, [2, 4]) == {2: NgramSetting(2, 3, 2), 4: NgramSetting(1, 3, 4)}


class ReferenceSuffixCache:
    """A suffix cache of the same contract as Arctic Inference's, written plainly: the longest suffix of the pattern
    (at most the tree's depth) that occurred earlier in the request's prompt and output or in an earlier request's
    output, continued by the tokens after its latest occurrence, min(K, factor x match) of them. No probabilities:
    every continuation is taken as certain (its min_token_prob is not modelled)."""

    def __init__(self, max_tree_depth: int, max_cached_requests: int):
        self.depth, self.active, self.done = max_tree_depth, {}, []
        self.active_requests = self.active.keys()

    def start_request(self, request, prompt):
        self.active[request] = (list(map(int, prompt)), [])

    def add_active_response(self, request, tokens):
        self.active[request][1].extend(tokens)

    def stop_request(self, request):
        self.done.append(self.active.pop(request)[1])

    def speculate(self, request, pattern, max_spec_tokens, max_spec_factor, min_token_prob):
        prompt, output = self.active[request]
        texts = [prompt + output, *self.done]
        pattern = list(map(int, pattern))
        for n in range(min(self.depth, len(pattern)), 0, -1):
            tail = pattern[-n:]
            for text in texts:
                own = text is texts[0]
                for start in range(len(text) - n - (1 if own else 0), -1, -1):
                    if text[start : start + n] == tail and start + n < len(text):
                        count = min(max_spec_tokens, int(max_spec_factor * n))
                        return SimpleNamespace(token_ids=text[start + n : start + n + count])
        return SimpleNamespace(token_ids=[])


def test_a_suffix_replay_feeds_the_cache_as_vllm_does_and_counts_the_steps():
    setting = SuffixSetting(max_tree_depth=8, max_spec_factor=1.0, min_token_prob=0.1, k=3)
    [counts] = replay_suffix(ReferenceSuffixCache, [(PROMPT, OUTPUT)], setting)
    # prefill emits 4; [1 2 3 4] occurred in the prompt: 5 1 2 proposed and accepted, 3 emitted; then
    # [.. 1 2 3] proposes 4 5 1: 4 accepted, 9 emitted: 3 forwards, as n-gram drafting at the same K
    assert counts == Replayed(steps=3, drafted=6, accepted=4)
    # a second request meets the first one's output in the cache: it drafts from it at once
    first, second = replay_suffix(ReferenceSuffixCache, [([50, 51], [52, 53, 54, 55]), ([52], [53, 54, 55])], setting)
    assert first == Replayed(steps=4) and second.accepted == 2 and second.steps == 2
    assert replay_suffix(ReferenceSuffixCache, [(PROMPT, [])], setting) == [Replayed()]


def test_the_suffix_replay_runs_arctic_inferences_cache():
    cache = suffix_cache_class()
    setting = SuffixSetting(max_tree_depth=8, max_spec_factor=1.0, min_token_prob=0.0, k=3)
    turns = [(PROMPT, OUTPUT), ([50, 51], [52, 53, 54, 55]), ([52], [53, 54, 55])]
    replayed = replay_suffix(cache, turns, setting)
    # every emitted token is counted once, whichever proposals were made
    assert [r.steps + r.accepted for r in replayed] == [len(o) for _, o in turns]
    # the third request finds the second's output in the cache and is accepted from it
    assert replayed[2].accepted >= 1


def test_the_suffix_grid_and_the_fewest_steps_win_per_k():
    grid = suffix_settings([12, 24], [1.0], [0.1, 0.3], [4, 8])
    assert len(grid) == 8 and SuffixSetting(24, 1.0, 0.3, 8) in grid
    counts = {
        SuffixSetting(12, 1.0, 0.1, 4): Replayed(30, drafted=50),
        SuffixSetting(24, 1.0, 0.1, 4): Replayed(30, drafted=40),
        SuffixSetting(12, 1.0, 0.3, 8): Replayed(28, drafted=60),
        SuffixSetting(24, 1.0, 0.3, 8): Replayed(28, drafted=60),
    }
    # a tie in steps goes to fewer tokens drafted, then the shallower tree
    assert best_suffix_per_k(counts, [4, 8]) == {4: SuffixSetting(24, 1.0, 0.1, 4), 8: SuffixSetting(12, 1.0, 0.3, 8)}


def test_params_problems_are_one_line_each_and_the_old_window_keys_say_where_they_went():
    with pytest.raises(ParamsError) as err:
        parse_params(
            {
                "free_sweep": {
                    "ks": [2, 2],
                    "lookup_min": 4,
                    "lookup_max": 3,
                    "timed_prompts": 0,
                    "suffix_ks": [0],
                    "suffix_min_token_probs": [1.5],
                }
            }
        )
    lines = str(err.value).splitlines()[1:]
    assert any("free_sweep.suffix_ks" in line and "every K must be at least 1" in line for line in lines)
    assert any("free_sweep.suffix_min_token_probs" in line and "from 0 to 1" in line for line in lines)
    assert any("free_sweep.ks" in line and "lists a K twice" in line for line in lines)
    assert any("free_sweep.lookup_min = 4 > free_sweep.lookup_max = 3" in line for line in lines)
    assert any(line.startswith("  - free_sweep.timed_prompts = 0:") for line in lines)
    with pytest.raises(
        ParamsError,
        match=r"evaluate.ngram_prompt_lookup_max: the n-gram baseline's window and K are "
        r"measured by the free_sweep stage",
    ):
        parse_params({"evaluate": {"ngram_prompt_lookup_max": 3}})
    defaults = parse_params({}).free_sweep
    assert (defaults.ks, defaults.lookup_min, defaults.lookup_max, defaults.timed_prompts) == ([3, 4, 5], 1, 5, 4)


def test_the_turns_tuned_on_are_those_after_evaluates_timed_ones(tiny_verifier_dir: Path, tmp_path: Path):
    verifier, prepared = pipeline_until_prepare(tmp_path, tiny_verifier_dir)
    params = parse_params(
        {
            "evaluate": {
                "timed_prompts": 30,
                "sets": [
                    {"name": "general", "source": "builtin:general", "headline": True},  # 32 conversations
                    {"name": "code", "source": "builtin:humaneval", "headline": True, "max_new_tokens": 16},
                    {"name": "few", "source": "builtin:general", "headline": True, "num_prompts": 8},  # none after 30
                    {"name": "sampled", "source": "builtin:general", "temperature": 0.7},
                ],
            }
        }
    )  # not a headline set
    turns, skipped = tuning_turns(params, FreeSweepPaths(verifier, prepared, tmp_path / "n.json"), max_k=4)
    assert [s.name for s in turns.sets] == ["general", "code"] and skipped == ["few"]
    assert [len(turns.prompts[name]) for name in ("general", "code")] == [2, 4]
    general = turns.sets[0]
    assert turns.prompts["general"][0] == general.render(general.conversations[30], 0, [], _tokenizer(verifier))
    assert len(turns.requests) == 1 + 6  # the warm-up's, then every timed prompt's
    none_after = parse_params(
        {
            "evaluate": {
                "timed_prompts": 40,
                "sets": [{"name": "general", "source": "builtin:general", "headline": True}],
            }
        }
    )
    with pytest.raises(
        EaglenestError,
        match=r"^evaluate.sets: no headline set has a conversation after the first "
        r"evaluate.timed_prompts = 40",
    ):
        tuning_turns(none_after, FreeSweepPaths(verifier, prepared, tmp_path / "n.json"), max_k=4)


def _tokenizer(verifier: Path):
    from eaglenest.artifacts.verifier import load_tokenizer

    return load_tokenizer(verifier)


class FakeNgramEngines:
    """The stage's engines, as names: the plain engine emits the given outputs; each n-gram engine decodes at its
    K's rate; every start's kwargs are kept."""

    def __init__(self, outputs: dict[str, list[list[int]]], rates: dict[int, float]):
        self.outputs, self.rates, self.kwargs, self.closed = outputs, rates, {}, []
        self.suffix_rate = 15.0

    def install(self, monkeypatch: pytest.MonkeyPatch, prompts: dict[str, list[list[int]]]) -> None:
        sets = [SimpleNamespace(name=n, params=SimpleNamespace(max_new_tokens=8, temperature=0.0)) for n in prompts]
        monkeypatch.setattr(
            ngram_stage, "tuning_turns", lambda params, paths, max_k: (TimedTurns(sets, prompts, [1], [64]), [])
        )
        monkeypatch.setattr(engines, "start_engine", self.start_engine)
        monkeypatch.setattr(engines, "stop_engine", self.closed.append)
        monkeypatch.setattr(engines, "sampling_params", lambda *args: None)
        monkeypatch.setattr(single_stream, "time_interleaved", self.time_interleaved)
        monkeypatch.setattr(ngram_stage, "generate", self.generate)
        monkeypatch.setattr(ngram_stage, "vllm_proposer", lambda: lookup)
        monkeypatch.setattr(ngram_stage, "suffix_cache_class", lambda: ReferenceSuffixCache)

    def start_engine(self, kwargs, param, what, warm_up, seed, shapes=None):
        self.kwargs[what] = kwargs
        return what, 1.0

    def generate(self, llm, requests, sampling, param):
        by_prompt = {
            tuple(p): o for name, ps in self.prompts_of.items() for p, o in zip(ps, self.outputs[name], strict=True)
        }
        return [
            SimpleNamespace(outputs=[SimpleNamespace(token_ids=by_prompt[tuple(r["prompt_token_ids"])])])
            for r in requests
        ]

    def time_interleaved(self, engines_, prompts, sampling, param, progress_desc):
        def seconds(what: str) -> float:
            if what.startswith("suffix decoding"):
                return 64 / self.suffix_rate
            k = next((k for k in self.rates if f"K = {k}" in what), None)
            return 64 / (10.0 if k is None else self.rates[k])

        return {
            name: [
                (
                    SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * 64, spec_decode_metrics=None)]),
                    seconds(what),
                )
                for _ in prompts
            ]
            for name, what in engines_.items()
        }


def test_the_stage_times_the_best_window_at_each_k_and_records_the_fastest(
    tmp_path: Path, monkeypatch, capsys, pipeline_folders
):
    verifier, draft = pipeline_folders
    prompts = {"code": [PROMPT, [7, 7, 8, 7, 7]], "chat": [[20, 21, 22]]}
    fake = FakeNgramEngines({"code": [OUTPUT, [8, 7, 7, 8]], "chat": [[23, 24, 25]]}, rates={2: 12.0, 3: 14.0, 4: 13.0})
    fake.prompts_of = prompts
    fake.install(monkeypatch, prompts)
    out = tmp_path / "metrics" / "free_sweep.json"
    params = parse_params(
        {
            "free_sweep": {
                "ks": [4, 2, 3],
                "lookup_max": 3,
                "suffix_ks": [4],
                "suffix_depths": [4, 8],
                "suffix_spec_factors": [1.0],
                "suffix_min_token_probs": [0.1],
            }
        }
    )
    record = sweep(params, FreeSweepPaths(verifier, tmp_path, out))

    # every window at every K replayed, every suffix setting too; at each K of each the one needing fewest steps
    # started, beside the plain engine
    assert len(record["replayed"]) == len(windows(1, 3)) * 3 and len(record["replayed_suffix"]) == 2
    started = [what for what in fake.kwargs if what != "the verifier"]
    ngram_started = [what for what in started if "n-gram drafting at window" in what]
    suffix_started = [what for what in started if what.startswith("suffix decoding at depth")]
    assert len(ngram_started) == 3 and len(suffix_started) == 1 and len(started) == 4
    plain = fake.kwargs["the verifier"]
    for what in started:
        assert {k: v for k, v in fake.kwargs[what].items() if k not in DRAFTING_KEYS} == plain
        method = fake.kwargs[what]["speculative_config"]["method"]
        assert method == ("ngram" if what in ngram_started else "suffix")
    assert fake.closed[-1] == "the verifier" and len(fake.closed) == 5
    # the fastest n-gram K (3 at 14 tok/s over plain's 10) is chosen and recorded with its figure; suffix decoding
    # (15 tok/s) is the fastest free drafter
    assert record["ngram"]["setting"]["num_speculative_tokens"] == 3
    assert record["ngram"]["serve"] == {"speedup": 1.4, "speedup_ci95": 0.0, "sets": ["code", "chat"]}
    assert record["suffix"]["serve"]["speedup"] == 1.5 and record["fastest"] == "suffix"
    assert record["suffix"]["setting"]["max_tree_depth"] in (4, 8)
    assert json.loads(out.read_text()) == record
    labels = [w.removeprefix("n-gram drafting at ").removeprefix("suffix decoding at ") for w in started]
    assert set(record["timed"]) == set(labels)
    assert all(record["timed"][label]["sets"]["code"]["speedup"] > 1 for label in labels)
    suffix_choice = measured_suffix("0" * 64, 2, out)
    assert suffix_choice.setting.k == 4 and "x1.50" in suffix_choice.why
    assert measured_suffix("f" * 64, 2, out).setting == SuffixSetting(24, 1.0, 0.1, 2)

    # evaluate and serve run it for this verifier, and say so; another verifier gets vLLM's default window
    setting = read_free_record(out).ngram
    choice = measured_ngram("0" * 64, 2, out)
    assert choice.setting == setting and "measured fastest by the free_sweep stage: x1.40 ± 0.00" in choice.why
    assert measured_ngram("f" * 64, 2, out).setting == NgramSetting(5, 5, 2)
    monkeypatch.chdir(tmp_path)  # serve reads metrics/free_sweep.json where it runs, by default
    assert (
        cli.main(
            ["serve", "--verifier", str(verifier), "--draft", str(draft), "--print-command", "--baseline", "ngram"]
        )
        == 0
    )
    captured = capsys.readouterr()
    argv = shlex.split(captured.out.strip())
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == setting.speculative_config()
    assert f"n-gram drafting at {setting.label} (measured fastest" in captured.err
    suffix = ["serve", "--verifier", str(verifier), "--draft", str(draft), "--print-command", "--baseline", "suffix"]
    assert cli.main(suffix) == 0
    captured = capsys.readouterr()
    argv = shlex.split(captured.out.strip())
    served = json.loads(argv[argv.index("--speculative-config") + 1])
    assert served == read_free_record(out).suffix.speculative_config() and served["method"] == "suffix"
    assert "suffix decoding at depth" in captured.err and "(measured fastest" in captured.err


def test_without_vllm_in_evaluate_nothing_is_measured_and_the_default_window_runs(tmp_path: Path, pipeline_folders):
    verifier, _ = pipeline_folders
    out = tmp_path / "free_sweep.json"
    sweep(parse_params({"evaluate": {"backend": "hf"}}), FreeSweepPaths(verifier, tmp_path, out))
    assert read_free_record(out).ngram is None
    choice = measured_ngram("0" * 64, 2, out)
    assert choice.setting == NgramSetting(5, 5, 2) and "measured none (evaluate.backend lists no vllm" in choice.why


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        json.dumps({"ngram": None}),
        json.dumps(
            {
                "verifier": {"fingerprint": "0" * 64},
                "ngram": {
                    "serve": None,
                    "setting": {"prompt_lookup_min": 4, "prompt_lookup_max": 2, "num_speculative_tokens": 3},
                },
                "suffix": None,
                "fastest": "ngram",
            }
        ),
        json.dumps({"verifier": {"fingerprint": "0" * 64}, "ngram": None, "suffix": None, "fastest": "eagle"}),
    ],
)
def test_a_broken_record_is_refused_in_one_line(tmp_path: Path, content: str):
    record = tmp_path / "free_sweep.json"
    record.write_text(content)
    with pytest.raises(EaglenestError) as err:
        measured_ngram("0" * 64, 2, record)
    assert str(err.value).count("\n") == 0 and str(record) in str(err.value) and "free_sweep" in str(err.value)


@pytest.mark.slow
@requires_vllm
def test_the_real_sweep_in_the_shared_pipeline(shared_pipeline: SharedPipeline):
    """The shared pipeline's `dvc repro` ran the stage with vLLM's CPU build (SHARED_PARAMS' free_sweep): the windows
    replayed on the turns after evaluate's timed ones, one engine per K timed, and evaluate ran the chosen one."""
    repo = shared_pipeline.repo
    assert "Running stage 'free_sweep'" in shared_pipeline.first_repro
    params = yaml.safe_load((repo / "params.yaml").read_text())
    record = json.loads((repo / "metrics" / "free_sweep.json").read_text())
    own = params["free_sweep"]
    assert record["ks"] == sorted(own["ks"]) and len(record["timed"]) == len(own["ks"]) + len(own["suffix_ks"])
    chosen = record["ngram"]["setting"]
    assert chosen["num_speculative_tokens"] in own["ks"] and record["ngram"]["serve"]["speedup"] > 0
    assert record["fastest"] in ("ngram", "suffix")
    assert record["suffix"]["serve"]["speedup"] > 0 and len(record["replayed_suffix"]) == 2
    for entry in record["timed"].values():
        for figures in entry["sets"].values():
            assert len(figures["turns"]) == len(figures["plain_turns"]) <= own["timed_prompts"]
    start = params["evaluate"]["timed_prompts"]
    assert all(turns["conversations"][0] == start for turns in record["turns"].values())
    steps = {(tuple(r["window"]), r["k"]): sum(s["steps"] for s in r["sets"].values()) for r in record["replayed"]}
    assert all(v > 0 for v in steps.values())
    details = json.loads((repo / "metrics" / "eval" / "details.json").read_text())
    for entry in details["runs"]["vllm"]["sets"].values():
        assert entry["ngram"]["window"] == [chosen["prompt_lookup_min"], chosen["prompt_lookup_max"]]
        assert entry["ngram"]["num_speculative_tokens"] == chosen["num_speculative_tokens"]
