"""The ``traffic:DIR`` source: served traffic (``eaglenest serve --record DIR``) as training conversations and as a
held-out evaluation slice.

The chat requests of the folder, oldest first, are split by time: the latest ``held_out`` share becomes the
prepared data's held-out traffic (:data:`~eaglenest.artifacts.prepared.TRAFFIC_HELD_OUT_FILE`, which the evaluate
set ``source: traffic`` reads) and is never trained on; the rest may be. Before the split, a request asked twice is
kept once (its latest time). Then every request that is an exact or near duplicate of a prompt of the evaluation
sets the project ships (HumanEval, general, long) is dropped from both sides, and every training request that is a
near duplicate of a held-out one is dropped from training, so a held-out prompt reaches training in no form.

Near duplicates: the user turns' text lowercased, runs of anything but letters and digits made one space, then
equal, or sharing at least ``NEAR_DUPLICATE_OVERLAP`` of the shorter text's word pairs (so a prompt quoted whole
inside a longer request counts too), looked up through an index of the pairs, so the cost grows with the overlap,
not with the product of the two sets.

``weight_by: acceptance`` orders the training requests by a weighted draw without replacement (each request's key
``u ** (1 / w)``, ``u`` uniform from ``prepare.seed``), ``w = 1 - draft_acceptance_rate`` (at least
``MIN_WEIGHT``): where the source's quota is smaller than its requests, those the draft accepted least are the
likeliest picked. A request served without drafting, or whose acceptance the server did not report, weighs the
mean of those that have one.
"""

from __future__ import annotations

import random
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglenest.artifacts.traffic import TRAFFIC_PREFIX
from eaglenest.artifacts.traffic.records import RecordedRequest, read_traffic
from eaglenest.core.errors import InputFileError
from eaglenest.stages.prepare.sources import Conversation, normalise_record

# Two texts are near duplicates where this share of the shorter one's word pairs is in the longer one: one word
# changed in a 16-word prompt keeps 13 of 15 pairs (0.87); a different question on the same topic keeps about a third.
NEAR_DUPLICATE_OVERLAP = 0.8
SHINGLE_WORDS = 2
# Texts with fewer word pairs than this are compared exactly only: two short greetings share most of their pairs.
MIN_SHINGLES = 6
MIN_WEIGHT = 0.05
# What metrics/prepare.json counts of a traffic source (every key, 0 included).
COUNTS = (
    "requests",
    "completions_skipped",
    "cut_lines",
    "not_text",
    "duplicates",
    "near_evaluation_prompts",
    "near_held_out",
    "held_out",
    "train",
)


def normalised(text: str) -> str:
    """Lowercased, anything but letters and digits one space: what exact-duplicate tests compare."""
    return " ".join(re.sub(r"[\W_]+", " ", text.casefold()).split())


def shingles(text: str) -> frozenset[str]:
    """The word pairs of ``text`` normalised."""
    words = normalised(text).split()
    return frozenset(" ".join(words[i : i + SHINGLE_WORDS]) for i in range(len(words) - SHINGLE_WORDS + 1))


class NearDuplicates:
    """Texts to compare against, indexed by their 3-grams.

    Args:
        texts: The texts a new one must not be a (near) duplicate of.
    """

    def __init__(self, texts: list[str]) -> None:
        self._sets: list[frozenset[str]] = []
        self._exact: set[str] = set()
        self._by_shingle: dict[str, list[int]] = defaultdict(list)
        for text in texts:
            self.add(text)

    def add(self, text: str) -> None:
        index = len(self._sets)
        self._sets.append(shingles(text))
        self._exact.add(normalised(text))
        for shingle in self._sets[index]:
            self._by_shingle[shingle].append(index)

    def matches(self, text: str) -> bool:
        """Whether ``text`` is, normalised, one of the texts, or shares ``NEAR_DUPLICATE_OVERLAP`` of the shorter
        one's word pairs with one (both at least ``MIN_SHINGLES`` pairs long)."""
        if normalised(text) in self._exact:
            return True
        mine = shingles(text)
        if len(mine) < MIN_SHINGLES:
            return False
        common: Counter[int] = Counter(i for s in mine for i in self._by_shingle.get(s, ()))
        return any(
            len(self._sets[i]) >= MIN_SHINGLES and shared >= NEAR_DUPLICATE_OVERLAP * min(len(mine), len(self._sets[i]))
            for i, shared in common.items()
        )


@dataclass
class TrafficSplit:
    """A traffic folder, split for training and evaluation.

    Attributes:
        train: The conversations training may take (context, user turn, the served reply), oldest first.
        weights: Each training conversation's weight (``weight_by``), or None (unweighted).
        held_out: The held-out slice as evaluation records (``messages`` up to the user turn asked, ``id``,
            ``category``, ``time``), oldest first.
        counts: What the split did, for metrics/prepare.json.
    """

    train: list[Conversation]
    weights: list[float] | None
    held_out: list[dict[str, Any]]
    counts: dict[str, Any] = field(default_factory=dict)


def _messages(request: RecordedRequest, where: str) -> list[dict[str, str]] | None:
    """A chat request's messages with text content (OpenAI's content parts joined), or None where a part is not
    text (an image: nothing a text draft learns from)."""
    messages = []
    for message in request.record.messages or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            if any(not isinstance(part, dict) or part.get("type") != "text" for part in content):
                return None
            content = "".join(str(part.get("text", "")) for part in content)
        messages.append({**message, "content": content})
    try:
        return normalise_record({"messages": messages}, where)
    except InputFileError as err:
        raise InputFileError(f"{err} (a chat request recorded by eaglenest serve --record)") from None


def _user_text(messages: list[dict[str, str]]) -> str:
    return "\n".join(m["content"] for m in messages if m["role"] == "user")


def split_traffic(
    directory: Path, held_out: float, weight_by: str | None, reference_prompts: list[str]
) -> TrafficSplit:
    """Reads and splits a traffic folder (see the module's description).

    Args:
        directory: The folder ``eaglenest serve --record`` wrote.
        held_out: The latest share of the requests held out for evaluation (0: none).
        weight_by: ``"acceptance"`` or None.
        reference_prompts: The evaluation prompts no request may duplicate.

    Raises:
        InputFileError: an unreadable folder or line, or no chat request in it.
    """
    what = f"prepare.source {TRAFFIC_PREFIX}{directory}"
    log = read_traffic(directory, what)
    chat = [r for r in log.requests if r.record.endpoint == "chat"]
    if not chat:
        raise InputFileError(
            f"{what}: none of its {len(log.requests)} requests is a chat request (/v1/chat/completions); prepare "
            "learns from chat messages"
        )
    counts: Counter[str] = Counter(dict.fromkeys(COUNTS, 0))
    counts.update(
        requests=len(log.requests), completions_skipped=len(log.requests) - len(chat), cut_lines=log.cut_lines
    )
    # Oldest first; a prompt asked again counts once, at its latest time (so the time split sees it once).
    latest: dict[str, tuple[RecordedRequest, list[dict[str, str]]]] = {}
    for request in sorted(chat, key=lambda r: r.record.time):
        messages = _messages(request, f"{what}: {request.origin}")
        if messages is None:
            counts["not_text"] += 1
            continue
        key = normalised("\n".join(f"{m['role']}: {m['content']}" for m in messages))
        counts["duplicates"] += key in latest
        latest.pop(key, None)
        latest[key] = (request, messages)
    ordered = list(latest.values())  # by time, a repeated prompt at its last
    reference = NearDuplicates(reference_prompts)
    kept = [(r, m) for r, m in ordered if not reference.matches(_user_text(m))]
    counts["near_evaluation_prompts"] = len(ordered) - len(kept)
    cut = len(kept) - round(len(kept) * held_out)
    if held_out > 0 and cut == len(kept) and len(kept) > 1:
        cut -= 1  # a share above 0 holds out at least one request
    later = kept[cut:]
    held_index = NearDuplicates([_user_text(m) for _, m in later])
    train = []
    for request, messages in kept[:cut]:
        if held_index.matches(_user_text(messages)):
            counts["near_held_out"] += 1
            continue
        train.append((request, messages))
    counts["held_out"] = len(later)
    counts["train"] = len(train)
    held_out_records = [
        {
            "messages": _up_to_last_user(messages),
            "id": f"traffic:{request.origin}",
            "category": "traffic",
            "time": request.record.time,
        }
        for request, messages in later
    ]
    conversations = [
        Conversation(
            origin=f"traffic:{request.origin}",
            messages=[*messages, {"role": "assistant", "content": request.record.reply}],
        )
        for request, messages in train
    ]
    weights = acceptance_weights([r for r, _ in train]) if weight_by == "acceptance" else None
    summary: dict[str, Any] = dict(sorted(counts.items()))
    summary["held_out_from"] = later[0][0].record.time if later else None
    summary["weight_by"] = weight_by
    return TrafficSplit(conversations, weights, held_out_records, summary)


def _up_to_last_user(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    return messages[: last_user + 1]


def acceptance_weights(requests: list[RecordedRequest]) -> list[float]:
    """``1 - draft_acceptance_rate`` per request (at least ``MIN_WEIGHT``); the mean of the known ones where the
    server did not draft or report it."""
    known = [
        max(MIN_WEIGHT, 1.0 - r.record.acceptance.draft_acceptance_rate)
        if r.record.acceptance is not None and r.record.acceptance.num_draft_tokens > 0
        else None
        for r in requests
    ]
    values = [w for w in known if w is not None]
    fallback = sum(values) / len(values) if values else 1.0
    return [fallback if w is None else w for w in known]


def weighted_order(weights: list[float], seed: int) -> list[int]:
    """Indices in a weighted draw without replacement (Efraimidis-Spirakis keys ``u ** (1 / w)``), reproducible
    from ``seed``."""
    rng = random.Random(seed)
    keys = [rng.random() ** (1.0 / w) for w in weights]
    return sorted(range(len(weights)), key=lambda i: keys[i], reverse=True)
