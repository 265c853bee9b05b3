"""``builtin:self-instruct``: user prompts the verifier writes itself, for a draft that generalizes.

A draft is accepted on the traffic it was trained on. Human chat data sets cover one kind of traffic each
(chitchat: small talk); the verifier, asked to play the user, writes the kinds of requests it was tuned
to answer — explanations, how-tos, code, math, writing — in its own words. So the chat template is rendered
up to where a user message starts (after an optional system message carrying a hint, e.g. "The user asks
for help with code.") and the verifier samples the message. Its replies are then written by regeneration,
like every other source's, so the hint never appears in a training row.

A prompt is kept when the verifier ended it (its end-of-turn token within ``prepare.prompt_max_new_tokens``),
it is not empty, and no earlier prompt has the same text (case and spacing aside). Batches are cached in
``.eaglenest/prompt-cache/<key>.json`` keyed by the verifier fingerprint, the generator (back end and
dtype), the sampling params, the seed and the batch's hints, so a rerun or a larger count writes no prompt
twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.artifacts.verifier import VerifierInfo
from eaglenest.core.atomic import atomic_write_json
from eaglenest.core.checkout import checkout_path
from eaglenest.core.errors import EaglenestError
from eaglenest.stages.prepare.params import PrepareParams
from eaglenest.stages.prepare.regenerate import VerifierGenerator
from eaglenest.stages.prepare.regenerate.job import ReplyGenerator, Sampling

log = logging.getLogger(__name__)

CACHE_ROOT = Path(".eaglenest") / "prompt-cache"
PARAM = "prepare.source builtin:self-instruct"

# What the user asks about, one hint per prompt in turn. "" lets the verifier pick; the rest cover the kinds
# of traffic a chat model serves (docs/defaults.md measures the mix they write).
DEFAULT_HINTS = (
    "",
    "The user asks for an explanation of a concept.",
    "The user asks how to do something practical.",
    "The user asks for a short piece of writing: a poem, a story, an email or a description.",
    "The user asks for help with code.",
    "The user asks a math question.",
    "The user asks a question about science, history or geography.",
    "The user asks for advice or an opinion.",
    "The user asks for a list of ideas.",
    "The user asks to summarize, rewrite or translate a text they give.",
)
_MARKER = "\x00user-message\x00"
# Tries per prompt asked for before giving up: a small verifier leaves some prompts unfinished within
# prepare.prompt_max_new_tokens, and a source that yields nothing must stop.
_MAX_TRIES_PER_PROMPT = 4


@dataclass
class PromptStats:
    """What prompt writing did, for metrics/prepare.json (``tokens``: generated in this run, cached batches
    excluded, so that prompt_tokens_per_s is a generation rate)."""

    written: int = 0
    tried: int = 0
    unfinished: int = 0
    duplicates: int = 0
    tokens: int = 0
    cache_hits: int = 0
    seconds: float = 0.0


def user_prefix(tokenizer: Any, hint: str) -> list[int]:
    """Token ids of the chat template rendered up to where a user message's text starts.

    Rendering a conversation whose user message is a marker and cutting at the marker works for any template
    that renders a system and a user message (the verifier's own default system prompt stays when ``hint``
    is empty).
    """
    messages = ([{"role": "system", "content": hint}] if hint else []) + [{"role": "user", "content": _MARKER}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as err:  # noqa: BLE001 (jinja raises its own types: a template refusing a system role)
        raise EaglenestError(
            f"prepare.prompt_hints: the verifier's chat template cannot render the hint {hint!r} as a system "
            f"message ({err}); set prepare.prompt_hints: [''] for a template without a system role"
        ) from None
    return tokenizer(text[: text.index(_MARKER)], add_special_tokens=False)["input_ids"]


def normalised(text: str) -> str:
    """A prompt's text for duplicate detection: lower case, single spaces."""
    return " ".join(text.lower().split())


def _batch_key(fingerprint: str, generator: str, sampling: Sampling, seed: int, hints: list[str]) -> str:
    payload = json.dumps([fingerprint, generator, sampling.temperature, sampling.max_new_tokens, seed, hints])
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def next_batch_size(batch_size: int, needed: int, written: int, tried: int) -> int:
    """Prompts to ask for next: a full batch until some prompt was kept, then no more than the yield so far says
    ``needed`` takes, with a quarter more as margin. The last batch of a run otherwise samples a full batch of
    which only a few are read (the demo's: 256 sampled for the 33 still needed)."""
    if written == 0:
        return batch_size
    return max(1, min(batch_size, math.ceil(1.25 * needed * tried / written)))


def write_prompts(
    count: int,
    generate: ReplyGenerator,
    tokenizer: Any,
    eot_ids: set[int],
    *,
    fingerprint: str,
    generator: str,
    sampling: Sampling,
    hints: list[str],
    seed: int,
    batch_size: int,
    cache_dir: Path = CACHE_ROOT,
) -> tuple[list[str], PromptStats]:
    """``count`` distinct user prompts written by the verifier, in a reproducible order.

    Raises:
        EaglenestError: naming the param, when the verifier wrote no usable prompt at all.
    """
    if not hints:
        raise EaglenestError("prepare.prompt_hints is empty; give at least one hint ('' = none), or null")
    cache_dir = checkout_path(cache_dir)  # the checkout's cache, also from a queued experiment's copy
    started = time.perf_counter()
    stats = PromptStats()
    prefixes = {hint: user_prefix(tokenizer, hint) for hint in dict.fromkeys(hints)}
    prompts: list[str] = []
    seen: set[str] = set()
    first = 0  # the next batch's first prompt, counted over every batch asked for
    while len(prompts) < count and stats.tried < _MAX_TRIES_PER_PROMPT * count:
        size = next_batch_size(batch_size, count - len(prompts), len(prompts), stats.tried)
        batch_hints = [hints[(first + i) % len(hints)] for i in range(size)]
        batch_seed = seed * 1_000_003 + first  # the batch's seed (hf); vLLM draws from its engine's stream
        cached = cache_dir / f"{_batch_key(fingerprint, generator, sampling, batch_seed, batch_hints)}.json"
        if cached.is_file():
            completions = json.loads(cached.read_text())
            stats.cache_hits += len(completions)
        else:
            completions = generate([prefixes[h] for h in batch_hints], batch_seed, sampling)
            atomic_write_json(cached, completions)
            stats.tokens += sum(map(len, completions))  # generated now: what prompt_tokens_per_s measures
        first += size
        for completion in completions:
            stats.tried += 1
            if not completion or completion[-1] not in eot_ids:  # cut at max_new_tokens: an unfinished request
                stats.unfinished += 1
                continue
            text = tokenizer.decode(completion, skip_special_tokens=True).strip()
            key = normalised(text)
            if not key or key in seen:
                stats.duplicates += 1
                continue
            seen.add(key)
            prompts.append(text)
            if len(prompts) == count:
                break
        log.info("self-instruct: %d / %d prompts written (%d tried)", len(prompts), count, stats.tried)
    if not prompts:
        raise EaglenestError(
            f"{PARAM}: the verifier wrote no usable prompt in {stats.tried} tries ({stats.unfinished} ran past "
            f"prepare.prompt_max_new_tokens = {sampling.max_new_tokens}, {stats.duplicates} empty or repeated); "
            "raise prepare.prompt_max_new_tokens or prepare.prompt_temperature, or drop the source"
        )
    stats.written = len(prompts)
    stats.seconds = time.perf_counter() - started
    return prompts, stats


def self_instruct_writer(
    params: PrepareParams, info: VerifierInfo, generator: VerifierGenerator, tokenizer: Any, eot_ids: set[int]
) -> Callable[[int], tuple[list[str], PromptStats]]:
    """The prepare stage's :data:`~eaglenest.stages.prepare.PromptWriter`: ``count`` -> prompts, with the stage's
    params, written by ``generator`` (the regeneration back end, on ``prepare.regenerate_vllm`` for vllm)."""

    def write(count: int) -> tuple[list[str], PromptStats]:
        hints = list(DEFAULT_HINTS) if params.prompt_hints is None else params.prompt_hints
        return write_prompts(
            count,
            generator.generate,
            tokenizer,
            eot_ids,
            fingerprint=info.fingerprint,
            generator=generator.name,
            sampling=Sampling(params.prompt_temperature, params.prompt_max_new_tokens),
            hints=hints,
            seed=params.seed,
            batch_size=params.regenerate_batch_size,
        )

    return write
