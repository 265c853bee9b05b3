"""The free drafters replayed on greedy outputs, with the code their engines run: the verify steps each n-gram
window and K, and each suffix decoding setting, takes, with no engine.

At temperature 0 speculative decoding emits the plain engine's tokens, so the whole run of an n-gram engine follows
from them: at each verify step the proposer looks the sequence so far up (the prompt and the tokens emitted), the
step accepts the proposal's prefix that matches the next emitted tokens and emits one more. vLLM's proposer is a
pure function of the sequence (``_find_longest_matched_ngram_and_propose_tokens``: the longest suffix within the
window that occurred before, its earliest occurrence, the K tokens after it), so calling it here replays exactly what
the engine would propose. Below float32 an engine's output may leave the plain one's at a near-tie; from there
the replay is an estimate.

Suffix decoding is replayed the same way with Arctic Inference's own ``SuffixDecodingCache``, fed as vLLM's
``SuffixDecodingProposer`` feeds it (:func:`replay_suffix`): each request's prompt starts its tree, every step's emitted
tokens are added, the pattern is the last ``max_tree_depth`` tokens, and a finished request's output stays in the
cache for the requests after it. So the turns are replayed in the order the engine is given them, one cache across
them, as a server's cache grows over its requests (the engine's warm-up requests, one or a few tokens each, are left
out).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from eaglenest.core.errors import EaglenestError
from eaglenest.core.measure.engines import NgramSetting, SuffixSetting

SUFFIX_CACHE = "arctic_inference.suffix_decoding.SuffixDecodingCache"
SUFFIX_MISSING = (
    "free_sweep.suffix_ks: suffix decoding needs arctic-inference (arctic_inference.suffix_decoding), which is not "
    "installed: `make setup` builds it from its sdist (docs/install.md), or set free_sweep.suffix_ks: [] to sweep "
    "n-gram drafting alone"
)
# vLLM's default for suffix_decoding_max_cached_requests: the finished requests whose outputs the cache keeps.
MAX_CACHED_REQUESTS = 10000
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


def suffix_cache_class() -> type:
    """Arctic Inference's ``SuffixDecodingCache``, the one vLLM's ``method: suffix`` runs.

    Raises:
        EaglenestError: arctic-inference is not installed (one line: what to do).
    """
    module, _, name = SUFFIX_CACHE.rpartition(".")
    try:
        return getattr(__import__(module, fromlist=[name]), name)
    except (ImportError, AttributeError):
        raise EaglenestError(SUFFIX_MISSING) from None


def replay_suffix(
    cache_class: type, turns: Sequence[tuple[Sequence[int], Sequence[int]]], setting: SuffixSetting
) -> list[Replayed]:
    """The verify steps ``setting`` takes on each of ``turns`` ((prompt, greedy output) in the order an engine is
    given them), one suffix cache across them."""
    cache = cache_class(max_tree_depth=setting.max_tree_depth, max_cached_requests=MAX_CACHED_REQUESTS)
    counts = []
    for index, (prompt, output) in enumerate(turns):
        request = f"turn-{index}"
        tokens = np.asarray([*prompt, *output], dtype=np.int32)
        cache.start_request(request, tokens[: len(prompt)])
        # the prefill emits the first token; every step after it verifies a proposal (or none) and emits one more
        emitted, steps, drafted, accepted = min(1, len(output)), min(1, len(output)), 0, 0
        if output:
            cache.add_active_response(request, [int(output[0])])
        while emitted < len(output):
            end = len(prompt) + emitted
            proposal = cache.speculate(
                request,
                tokens[max(0, end - setting.max_tree_depth) : end],
                max_spec_tokens=setting.k,
                max_spec_factor=setting.max_spec_factor,
                min_token_prob=setting.min_token_prob,
            ).token_ids
            matched = 0
            while (
                matched < len(proposal)
                and emitted + matched < len(output)
                and int(proposal[matched]) == output[emitted + matched]
            ):
                matched += 1
            steps, drafted, accepted = steps + 1, drafted + len(proposal), accepted + matched
            cache.add_active_response(request, [int(t) for t in output[emitted : emitted + matched + 1]])
            emitted += matched + 1
        cache.stop_request(request)
        counts.append(Replayed(steps, drafted, accepted))
    return counts


def suffix_settings(
    depths: Sequence[int], factors: Sequence[float], min_probs: Sequence[float], ks: Sequence[int]
) -> list[SuffixSetting]:
    """Every suffix decoding setting of the grid."""
    return [
        SuffixSetting(depth, factor, min_prob, k)
        for depth in depths
        for factor in factors
        for min_prob in min_probs
        for k in ks
    ]


def best_suffix_per_k(counts: dict[SuffixSetting, Replayed], ks: Sequence[int]) -> dict[int, SuffixSetting]:
    """Per K, the suffix setting whose replay needs the fewest verify steps (ties: the fewer tokens drafted, which
    the verifier checks at a cost; then the shallower tree)."""
    return {
        k: min(
            (setting for setting in counts if setting.k == k),
            key=lambda s: (counts[s].steps, counts[s].drafted, s.max_tree_depth),
        )
        for k in ks
    }
