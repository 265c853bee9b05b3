"""n-gram drafting replayed on greedy outputs with vLLM's own proposer: the verify steps each lookup window and K
takes, with no engine.

At temperature 0 speculative decoding emits the plain engine's tokens, so the whole run of an n-gram engine follows
from them: at each verify step the proposer looks the sequence so far up (the prompt and the tokens emitted), the
step accepts the proposal's prefix that matches the next emitted tokens and emits one more. vLLM's proposer is a
pure function of the sequence (``_find_longest_matched_ngram_and_propose_tokens``: the longest suffix within the
window that occurred before, its earliest occurrence, the K tokens after it), so calling it here replays exactly what
the engine would propose. Below float32 an engine's output may leave the plain one's at a near-tie; from there
the replay is an estimate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from eaglenest.core.errors import EaglenestError
from eaglenest.core.measure.engines import NgramSetting

PROPOSER = "vllm.v1.spec_decode.ngram_proposer._find_longest_matched_ngram_and_propose_tokens"
# Proposer = (tokens so far, prompt_lookup_min, prompt_lookup_max, max_model_len, k) -> the drafted tokens.
Proposer = Callable[[np.ndarray, int, int, int, int], np.ndarray]


def vllm_proposer() -> Proposer:
    """vLLM's n-gram proposer function.

    Raises:
        EaglenestError: this vLLM has none by that name (one line: the replay would not be vLLM's).
    """
    module, _, name = PROPOSER.rpartition(".")
    try:
        return getattr(__import__(module, fromlist=[name]), name)
    except (ImportError, AttributeError) as err:
        raise EaglenestError(
            f"free_sweep: this vLLM has no {PROPOSER} ({type(err).__name__}: {err}), which the "
            "sweep replays n-gram drafting with; list one window (free_sweep.lookup_min = "
            "lookup_max) to time it without the replay"
        ) from None


@dataclass(frozen=True)
class Replayed:
    """One setting's counts over some turns.

    Attributes:
        steps: Verifier forwards: the prefill's, then one per verify step.
        drafted: Tokens proposed.
        accepted: Tokens accepted.
    """

    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    def __add__(self, other: Replayed) -> Replayed:
        return Replayed(self.steps + other.steps, self.drafted + other.drafted, self.accepted + other.accepted)


def replay(propose: Proposer, prompt: Sequence[int], output: Sequence[int], setting: NgramSetting) -> Replayed:
    """The verify steps ``setting`` takes to emit ``output`` after ``prompt`` (greedy decoding)."""
    tokens = np.asarray([*prompt, *output], dtype=np.int32)  # as the engine holds them
    # the prefill emits the first token; every step after it verifies a proposal (or none) and emits one more
    emitted, steps, drafted, accepted = min(1, len(output)), min(1, len(output)), 0, 0
    no_limit = len(tokens) + setting.k + 1  # the engine's max_model_len holds every draft of the run
    while emitted < len(output):
        proposal = propose(
            tokens[: len(prompt) + emitted], setting.prompt_lookup_min, setting.prompt_lookup_max, no_limit, setting.k
        )
        matched = 0
        while (
            matched < len(proposal)
            and emitted + matched < len(output)
            and int(proposal[matched]) == output[emitted + matched]
        ):
            matched += 1
        steps, drafted, accepted = steps + 1, drafted + len(proposal), accepted + matched
        emitted += matched + 1
    return Replayed(steps, drafted, accepted)


def windows(lookup_min: int, lookup_max: int) -> list[tuple[int, int]]:
    """Every lookup window ``(low, high)`` with ``lookup_min <= low <= high <= lookup_max``."""
    return [(low, high) for low in range(lookup_min, lookup_max + 1) for high in range(low, lookup_max + 1)]


def best_window_per_k(counts: dict[NgramSetting, Replayed], ks: list[int]) -> dict[int, NgramSetting]:
    """Per K, the setting whose replay needs the fewest verify steps (ties: the narrower window, then the lower one:
    it looks up less)."""
    best = {}
    for k in ks:
        at_k = [setting for setting in counts if setting.k == k]
        best[k] = min(
            at_k, key=lambda s: (counts[s].steps, s.prompt_lookup_max - s.prompt_lookup_min, s.prompt_lookup_min)
        )
    return best
