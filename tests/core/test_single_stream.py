"""Single-stream timing (``eaglenest.core.single_stream``) without an engine: the turn order, the engine count
per process, and the counts read from a request."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from eaglenest.core import single_stream


def test_interleaved_timing_rotates_the_engines_prompt_by_prompt(monkeypatch: pytest.MonkeyPatch):
    calls: list[tuple[str, int]] = []

    def fake_generate(llm, requests, sampling, param):
        calls.append((llm, requests[0]["prompt_token_ids"][0]))
        return [f"{llm} answers {requests[0]['prompt_token_ids'][0]}"]

    monkeypatch.setattr(single_stream, "generate", fake_generate)
    timed = single_stream.time_interleaved({"plain": "plain", "a": "a", "b": "b"}, [[0], [1], [2], [3]], None,
                                           "k_sweep", "timed turns")
    assert calls == [("plain", 0), ("a", 0), ("b", 0), ("a", 1), ("b", 1), ("plain", 1),
                     ("b", 2), ("plain", 2), ("a", 2), ("plain", 3), ("a", 3), ("b", 3)]
    assert [output for output, _ in timed["a"]] == [f"a answers {i}" for i in range(4)]
    assert all(seconds >= 0 for pairs in timed.values() for _, seconds in pairs)


def test_the_engines_after_the_third_in_a_process_get_processes_of_their_own(monkeypatch: pytest.MonkeyPatch):
    in_process: list[bool] = []
    monkeypatch.setattr(single_stream, "_started_in_process", 0)
    monkeypatch.setattr(single_stream, "create_llm", lambda kwargs, param, what, in_process_on_cpu: in_process.append(
        in_process_on_cpu) or what)
    given: list[tuple[list[int], int]] = []
    monkeypatch.setattr(single_stream, "generate", lambda llm, requests, sampling, param: given.append(
        (requests[0]["prompt_token_ids"], sampling)))
    monkeypatch.setattr(single_stream, "sampling_params", lambda max_tokens, temperature, seed: max_tokens)
    for number in range(5):
        llm, seconds = single_stream.start_engine({}, "k_sweep", f"engine {number}", [1], 0, [[2], [3, 4]])
        assert llm == f"engine {number}" and seconds >= 0
    assert in_process == [True, True, True, False, False]
    # each engine: the warm-up decoded, then every timed prompt alone for one token (its length's kernels)
    assert given[:3] == [([1], single_stream.WARM_UP_TOKENS), ([2], 1), ([3, 4], 1)] and len(given) == 15


def test_drafted_steps_come_from_the_requests_histogram():
    output = SimpleNamespace(outputs=[SimpleNamespace(spec_decode_metrics=SimpleNamespace(histogram=[3, 2, 1]))])
    assert single_stream.drafted_steps(output) == (6, 4)  # 6 steps; 2 accepted one draft, 1 accepted two
    assert single_stream.drafted_steps(SimpleNamespace(outputs=[SimpleNamespace()])) is None
