"""The temperature-0 check: the draft server's outputs against the baseline's, and the near-tie rule on the baseline's
replay of a prompt that differs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from eaglenest.commands.bench.endpoint import Endpoint
from eaglenest.core.errors import EaglenestError
from eaglenest.core.lossless_rule import TIE_CANDIDATES, Divergence, TopCandidates, first_divergence, is_lossless


@dataclass(frozen=True)
class Comparison:
    """The draft server's outputs against the baseline's, request by request.

    Attributes:
        compared: Requests that succeeded on both sides.
        differ: ``{"request": i, "prompt": id}`` of each compared request whose texts differ.
    """

    compared: int
    differ: list[dict[str, Any]]

    @property
    def identical(self) -> int:
        return self.compared - len(self.differ)


@dataclass(frozen=True)
class Verdict:
    """One differing output under the near-tie rule.

    Attributes:
        near_tie: The draft's output left the baseline's only at a near-tie.
        detail: What bench.json records of it: where (``position``), which tokens (``baseline_token``,
            ``draft_token`` and their texts), the ``gap`` and ``rank``, or ``why`` it is not a near-tie.
    """

    near_tie: bool
    detail: dict[str, Any]


def compare_outputs(draft: dict[str, Any], baseline: dict[str, Any], prompt_ids: list[str]) -> Comparison:
    """The temperature-0 check: request by request (request i is prompt i mod P), are the texts identical?

    Requests that failed on either side are not compared.
    """
    compared, differ = 0, []
    for i, (ours, theirs) in enumerate(zip(draft["generated_texts"], baseline["generated_texts"], strict=True)):
        if draft["errors"][i] or baseline["errors"][i]:
            continue
        compared += 1
        if ours != theirs:
            differ.append({"request": i, "prompt": prompt_ids[i % len(prompt_ids)]})
    return Comparison(compared, differ)


@dataclass(frozen=True)
class Replay:
    """The baseline's answer to one prompt asked alone at temperature 0.

    Attributes:
        tokens: Its output token ids.
        top: Its top candidates (token, log-prob) at each output position, best first.
        text: Its output text, as the server detokenized it.
    """

    tokens: list[int]
    top: list[TopCandidates]
    text: str


def ask_with_logprobs(endpoint: Endpoint, model: str, prompt: list[int], max_tokens: int, timeout_s: float) -> Replay:
    """The baseline's output for ``prompt`` alone, with its top ``TIE_CANDIDATES`` log-probs at each token.

    The request is the measured one (token ids, ``max_tokens``, ``repetition_penalty`` 1 as ``vllm bench serve``
    sends it) at temperature 0, unstreamed, with vLLM's ``return_tokens_as_token_ids`` so candidates come as ids.

    Raises:
        ServerGone: nothing answers.
        EaglenestError: the server refused the request, or answered without token-id log-probs.
    """
    body = endpoint.post(
        "/v1/completions",
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "repetition_penalty": 1.0,
            "logprobs": TIE_CANDIDATES,
            "return_tokens_as_token_ids": True,
            "stream": False,
        },
        timeout_s,
    )
    try:
        return parse_replay(body)
    except ValueError as err:
        raise EaglenestError(f"{endpoint.flag} {endpoint.url}: {err}") from None


def parse_replay(body: Any) -> Replay:
    """A completion answer with ``logprobs`` and ``return_tokens_as_token_ids`` as a :class:`Replay`.

    Raises:
        ValueError: an answer of another shape (one line).
    """
    try:
        choice = body["choices"][0]
        logprobs = choice["logprobs"]
        tokens = [_token_id(token) for token in logprobs["tokens"]]
        # vLLM lists the chosen token, then the top ones: ranked here by log-prob, as evaluate ranks them
        top = [
            sorted(
                ((_token_id(key), float(value)) for key, value in (position or {}).items()),
                key=lambda candidate: -candidate[1],
            )[:TIE_CANDIDATES]
            for position in logprobs["top_logprobs"]
        ]
        text = str(choice["text"])
    except (KeyError, IndexError, TypeError, ValueError) as err:
        raise ValueError(
            f"the completion has no token-id log-probs ({type(err).__name__}: {err}); is it a vLLM "
            "server (logprobs with return_tokens_as_token_ids)?"
        ) from None
    if len(top) != len(tokens):
        raise ValueError(f"the completion has {len(tokens)} tokens but log-probs for {len(top)}")
    return Replay(tokens, top, text)


def _token_id(token: str) -> int:
    match = re.fullmatch(r"token_id:(\d+)", token)
    if match is None:
        raise ValueError(f"token {token!r} is not token_id:N")
    return int(match.group(1))


def _text(tokenizer: Any, ids: list[int]) -> str:
    """Output ids as the server's output text (special tokens skipped, no clean-up of spaces)."""
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _whole(text: str) -> str:
    """``text`` without a character cut in two at its end (decoded bytes of an incomplete character)."""
    return text.rstrip("\ufffd")


def draft_divergence(
    draft_text: str, plain: list[int], plain_top: list[TopCandidates], tokenizer: Any
) -> Divergence | None:
    """Where the draft's output text first leaves the baseline's tokens, judged by :func:`first_divergence`.

    The divergence is the first baseline token whose text the draft's text does not continue with (or an end the
    draft did not share). The draft's token there is the longest of the baseline's candidates whose text the
    draft's continues with (an end token: where the draft's text ends there); none: the divergence has no gap.

    Args:
        draft_text: The draft server's output text.
        plain: The baseline's output token ids for the same prompt.
        plain_top: The baseline's top candidates at each of its output positions.
        tokenizer: The served model's tokenizer.

    Returns:
        None when the draft's text is the baseline's.
    """
    prefixes = [_text(tokenizer, plain[:i]) for i in range(len(plain) + 1)]
    for i, token in enumerate(plain):
        before, upto = prefixes[i], prefixes[i + 1]
        if upto == before:  # no text (a special token): the draft must end here too when the baseline does
            if i < len(plain) - 1 or draft_text == before:
                continue
        elif draft_text.startswith(_whole(upto)):
            continue
        matches = []
        for rank, (candidate, _) in enumerate(plain_top[i] if i < len(plain_top) else []):
            if candidate == token:
                continue
            text = _text(tokenizer, plain[:i] + [candidate])
            if text == before:
                if draft_text == before:
                    matches.append((0, -rank, candidate))
            elif len(_whole(text)) > len(_whole(before)) and draft_text.startswith(_whole(text)):
                matches.append((len(_whole(text)), -rank, candidate))
        spec = plain[:i] + ([max(matches)[2]] if matches else [])
        return first_divergence(plain, spec, plain_top)
    if draft_text == prefixes[-1]:
        return None
    return Divergence(len(plain), None, None, None, None)  # the draft's text goes on past the baseline's


def tokenization_alternatives(
    draft_text: str, plain: list[int], plain_top: list[TopCandidates], tokenizer: Any, before: int
) -> list[Divergence]:
    """Other divergences the draft's text allows up to position ``before`` (latest first): positions where the
    draft's text continues with the baseline's token and also with a longer candidate of the baseline's top ones,
    and at ``before`` every candidate the text continues with.

    The bench receives the draft's text, not its tokens: where the baseline emitted ``' '`` and then ``'1'``, a draft
    that emitted ``' delim'`` there reads as having taken ``' '`` and parted one position later, at a token the
    baseline never considered. Each alternative is the divergence as if the draft had taken that longer candidate.
    """
    found = []
    for i in range(min(before + 1, len(plain))):
        # before the divergence the draft's text continues with the baseline's token, and only a longer candidate
        # is another reading; at it, any candidate the text continues with is one (not only the longest)
        shared = _whole(_text(tokenizer, plain[: i + 1] if i < before else plain[:i]))
        if i < before and not draft_text.startswith(shared):
            break
        for candidate, _ in plain_top[i] if i < len(plain_top) else []:
            text = _whole(_text(tokenizer, plain[:i] + [candidate]))
            if candidate != plain[i] and len(text) > len(shared) and draft_text.startswith(text):
                divergence = first_divergence(plain, plain[:i] + [candidate], plain_top)
                if divergence is not None:
                    found.append(divergence)
    return found[::-1]


def judge_difference(draft_text: str, replay: Replay | str, tokenizer: Any, margin: float) -> Verdict:
    """One differing output under the near-tie rule: whether it is a near-tie, and where, which tokens, the gap, or
    why not.

    Args:
        draft_text: The draft server's output text.
        replay: The baseline's replay of the prompt, or why there is none.
        tokenizer: The served model's tokenizer.
        margin: ``--tie-margin``.
    """
    if isinstance(replay, str):
        return Verdict(False, {"why": replay})
    if _text(tokenizer, replay.tokens) != replay.text:
        return Verdict(
            False,
            {
                "why": "the tokenizer decodes the baseline's tokens to another text than the "
                "server's, so the draft's text cannot be placed on them"
            },
        )
    divergence = draft_divergence(draft_text, replay.tokens, replay.top, tokenizer)
    if divergence is None:
        return Verdict(
            True,
            {
                "position": None,
                "why": "the baseline asked alone gives the draft's text: its own output varies between runs",
            },
        )
    ambiguous = False
    if not is_lossless(divergence, margin):
        # the text may hide where the draft's tokens parted: take an earlier reading that is a near-tie, if any
        for alternative in tokenization_alternatives(
            draft_text, replay.tokens, replay.top, tokenizer, divergence.position
        ):
            if is_lossless(alternative, margin):
                divergence, ambiguous = alternative, True
                break
    at = len(_whole(_text(tokenizer, replay.tokens[: divergence.position])))
    entry: dict[str, Any] = {
        "position": divergence.position,
        "baseline_token": divergence.plain_token,
        "baseline_text": None if divergence.plain_token is None else tokenizer.decode([divergence.plain_token]),
        "draft_token": divergence.spec_token,
        "draft_text": (
            tokenizer.decode([divergence.spec_token]) if divergence.spec_token is not None else draft_text[at : at + 16]
        ),
        "gap": divergence.gap,
        "rank": divergence.spec_rank,
    }
    if ambiguous:
        entry["read_from_text"] = (
            "only the draft's text comes back, and it reads as this token here as well as "
            "the way that parts beyond a near-tie: read as this one"
        )
    near = is_lossless(divergence, margin)
    if not near:
        if divergence.plain_token is None:
            entry["why"] = "the draft's output goes on where the baseline's ends"
        elif divergence.gap is None:
            entry["why"] = f"the draft's text there begins with none of the baseline's top {TIE_CANDIDATES} tokens"
        else:
            entry["why"] = f"the gap {divergence.gap:g} is above the margin {margin:g}"
    return Verdict(near, entry)
