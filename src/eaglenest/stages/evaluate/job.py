"""The evaluate back ends' contract: what a back end is given (:class:`EvaluationJob`), what it returns (one
records entry per set, the format of :mod:`eaglenest.artifacts.evaluation`) and what every back end does the
same way: asking a set's turns in order (:func:`ask_turns`) and writing one record per turn
(:func:`turn_record`). Back ends import this module, never the stage that dispatches to them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from eaglenest.artifacts.eval_params import EvaluateParams
from eaglenest.artifacts.eval_sets import EvalConversation, EvalSet
from eaglenest.core.measure.single_stream import SECONDS_PLACES
from eaglenest.stages.evaluate.acceptance import Acceptance
from eaglenest.stages.evaluate.lossless import TopCandidates, first_divergence, is_lossless


@dataclass(frozen=True)
class EvaluationJob:
    """Everything an evaluate back end needs.

    Attributes:
        params: The evaluate params.
        verifier_dir: The verifier stage's output folder.
        sets: The evaluation sets, loaded.
        draft_dir: The train stage's speculators checkpoint.
        ngram_record: The free_sweep stage's record: the n-gram baseline's window and K (vllm); None, or no file:
            vLLM's default window at the draft's K.
    """

    params: EvaluateParams
    verifier_dir: Path
    sets: list[EvalSet]
    draft_dir: Path
    ngram_record: Path | None = None


# A back end returns {"dtype": ..., "sets": {set name: {"records": [...], ...}}} (artifacts.evaluation).
Backend = Callable[[EvaluationJob], dict[str, Any]]


@dataclass(frozen=True)
class Turn:
    """One prompt turn to decode: which conversation, which turn (0-based), its token ids."""

    conversation: EvalConversation
    turn: int
    prompt: list[int]


Output = TypeVar("Output")


def ask_turns(
    eval_set: EvalSet,
    conversations: list[EvalConversation],
    tokenizer: Any,
    decode: Callable[[list[list[int]]], list[Output]],
    tokens_of: Callable[[Output], list[int]],
) -> tuple[list[Turn], list[Output]]:
    """Every turn of ``conversations``, each later turn asked after the plain decoder's answer to the earlier ones.

    Turns are decoded round by round (all first turns in one ``decode`` call, then all second turns), so a
    batching back end batches each round. Returns the turns in conversation order (a conversation's turns
    together) and ``decode``'s output for each.
    """
    answers: dict[int, list[str]] = {i: [] for i in range(len(conversations))}
    decoded: dict[tuple[int, int], tuple[Turn, Output]] = {}
    for turn in range(max(len(c.turns) for c in conversations)):
        asked = [i for i, c in enumerate(conversations) if len(c.turns) > turn]
        turns = [
            Turn(conversations[i], turn, eval_set.render(conversations[i], turn, answers[i], tokenizer)) for i in asked
        ]
        for i, item, output in zip(asked, turns, decode([t.prompt for t in turns]), strict=True):
            answers[i].append(tokenizer.decode(tokens_of(output), skip_special_tokens=True))
            decoded[(i, turn)] = (item, output)
    ordered = [decoded[key] for key in sorted(decoded)]
    return [t for t, _ in ordered], [o for _, o in ordered]


def turn_record(
    item: Turn,
    acceptance: Acceptance,
    plain: list[int],
    spec: list[int],
    *,
    plain_top: list[TopCandidates] | None = None,
    tie_margin: float | None = None,
    check_lossless: bool = True,
) -> dict[str, Any]:
    """One turn's record: the draft's counts, and whether speculation kept plain decoding's tokens.

    Args:
        item: The turn.
        acceptance: The draft's counts on it.
        plain: Plain decoding's output; spec: speculative decoding's.
        plain_top: The plain run's top candidates per output position, for the near-tie rule.
        tie_margin: None: the exact rule (float32); else the near-tie rule's margin.
        check_lossless: False at a sampling temperature, where outputs differ by design (lossless is then
            not claimed per prompt: the verifier's distribution is kept, not its tokens).
    """
    divergence = first_divergence(plain, spec, plain_top)
    lossless = is_lossless(divergence, tie_margin)
    return {
        "id": item.conversation.id,
        "turn": item.turn + 1,
        "category": item.conversation.category,
        "prompt_tokens": len(item.prompt),
        "steps": acceptance.steps,
        "accepted": acceptance.accepted,
        "drafted": acceptance.drafted,
        "per_position": list(acceptance.per_position[: acceptance.k]),
        "identical": divergence is None,
        "lossless": bool(lossless) if check_lossless else True,
        **(
            {
                "divergence": {
                    "position": divergence.position,
                    "plain_token": divergence.plain_token,
                    "spec_token": divergence.spec_token,
                    "gap": divergence.gap,
                }
            }
            if divergence is not None and check_lossless
            else {}
        ),
        "plain_tokens": None,
        "plain_s": None,
        "spec_tokens": None,
        "spec_s": None,
    }


def add_timing(record: dict[str, Any], drafter: str, tokens: int, seconds: float) -> None:
    """Records ``drafter``'s (plain, spec, ngram or suffix) single-stream decoding of the turn: tokens and seconds."""
    record[f"{drafter}_tokens"], record[f"{drafter}_s"] = tokens, round(seconds, SECONDS_PLACES)


def add_free(record: dict[str, Any], acceptance: Acceptance, drafter: str = "ngram") -> None:
    """Records a free drafter's (``ngram`` or ``suffix``) counts on the turn."""
    record.update(
        {
            f"{drafter}_steps": acceptance.steps,
            f"{drafter}_accepted": acceptance.accepted,
            f"{drafter}_drafted": acceptance.drafted,
            f"{drafter}_per_position": list(acceptance.per_position[: acceptance.k]),
        }
    )


def set_entry(eval_set: EvalSet, records: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """One set's entry in a back end's result: how it was decoded, and its records."""
    return {
        "source": eval_set.params.source,
        "temperature": eval_set.params.temperature,
        "max_new_tokens": eval_set.params.max_new_tokens,
        "chat_template": eval_set.params.chat_template,
        **extra,
        "records": records,
    }
