"""The baseline every draft must beat: prompt-lookup (n-gram) drafting, which vLLM offers for free
(``speculative_config={"method": "ngram"}``), replayed on the verifier's own greedy output."""

from __future__ import annotations

from eaglenest.stages.evaluate.acceptance import Acceptance


def ngram_acceptance(prompt: list[int], output: list[int], k: int, max_ngram: int = 3) -> Acceptance:
    """Prompt-lookup drafting replayed on a greedy output: its acceptance counts.

    At each step the longest suffix (up to ``max_ngram`` tokens) of the sequence so far that occurred
    earlier proposes the ``k`` tokens that followed it; greedy verification accepts the prefix that
    matches the verifier's output. A step with no match drafts nothing and accepts 0, so tau counts it.
    Greedy decoding is deterministic, so replaying on its output gives exactly the live figures.
    """
    sequence = list(prompt)
    position = 0
    counts = Acceptance(k)
    while position < len(output):
        proposal = _lookup(sequence + output[:position], k, max_ngram)
        accepted = 0
        while (
            accepted < len(proposal)
            and position + accepted < len(output)
            and proposal[accepted] == output[position + accepted]
        ):
            accepted += 1
        counts.add_step(len(proposal), accepted)
        position += accepted + 1
    return counts


def _lookup(sequence: list[int], k: int, max_ngram: int) -> list[int]:
    for n in range(min(max_ngram, len(sequence) - 1), 0, -1):
        suffix = sequence[-n:]
        for start in range(len(sequence) - n - 1, -1, -1):  # most recent earlier occurrence first
            if sequence[start : start + n] == suffix:
                return sequence[start + n : start + n + k]
    return []
