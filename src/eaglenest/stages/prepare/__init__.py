"""The prepare stage: conversations -> token ids with a loss mask on exactly the assistant tokens.

Each conversation is rendered with the verifier's own chat template. The loss mask is 1 on the tokens
the verifier would generate as the assistant — the reply's content and its end-of-turn token — and 0 on
system, user and template tokens (role headers, the newline a template adds after end-of-turn).

Output (speculators' ``prepare-data`` schema, so its ``ArrowDataset`` opens it): a ``datasets``
``save_to_disk`` folder with ``input_ids``, ``loss_mask`` (int64) and ``seq_len``, train rows first and
validation rows last, plus ``split.json`` (row counts and the ``train_ratio`` that reproduces the split
in speculators) and ``val_prompts.jsonl`` (each validation conversation up to its first user turn, for
evaluation prompts).
"""

from __future__ import annotations

import bisect
import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglenest.artifacts.prepared import write_prepared
from eaglenest.core.atomic import atomic_write_json
from eaglenest.core.chat import chat_template_kwargs, template_handles_reasoning, without_reasoning
from eaglenest.core.errors import EaglenestError, InputFileError, ParamsError, TemplateError
from eaglenest.core.params import SELF_INSTRUCT_SOURCE, PrepareParams
from eaglenest.stages.prepare.sources import Conversation, read_source

log = logging.getLogger(__name__)

DROP_REASONS = ("no_assistant_turn", "no_assistant_tokens_after_truncation")
IMPORT_PREFIX = "import:"


@dataclass(frozen=True)
class PreparedRow:
    """One conversation as training data.

    Attributes:
        input_ids: ``[seq]`` token ids of the rendered conversation.
        loss_mask: ``[seq]`` 1 on assistant tokens (content + end-of-turn), else 0.
        truncated: Whether ``max_len`` cut the conversation.
    """

    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool


def _render(tokenizer: Any, messages: list[dict[str, str]], *, generation_prompt: bool,
            chat_kwargs: dict[str, Any] | None = None) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                         **(chat_kwargs or {}))


def assistant_turn_spans(tokenizer: Any, messages: list[dict[str, str]], chat_kwargs: dict[str, Any] | None = None
                         ) -> list[tuple[str, int, int]]:
    """Each assistant reply rendered against exactly the context the model saw when it wrote it.

    For assistant turn ``j``: ``before`` is ``messages[:j]`` rendered *with* the generation prompt (what the
    model is given; its ``<|im_start|>assistant\n`` header, or ``<think>\n\n</think>`` with thinking off, is
    not the model's), ``through`` is ``messages[:j+1]`` rendered without it; the reply is the span between.
    Returns ``(through, len(before), len(through))`` per reply.

    Raises:
        TemplateError: ``before`` is not a prefix of ``through``: the template cannot be rendered per turn.
    """
    turns = []
    for j, message in enumerate(messages):
        # A conversation opening with the assistant has no prompt to condition on: context only.
        if message["role"] != "assistant" or j == 0:
            continue
        before = _render(tokenizer, messages[:j], generation_prompt=True, chat_kwargs=chat_kwargs)
        through = _render(tokenizer, messages[: j + 1], generation_prompt=False, chat_kwargs=chat_kwargs)
        if not through.startswith(before):
            name = getattr(tokenizer, "name_or_path", "") or "the verifier"
            raise TemplateError(
                f"{name}: its chat template cannot be rendered per turn: messages[:{j}] rendered with the "
                f"generation prompt is not a prefix of messages[:{j + 1}] rendered with the reply, so the reply's "
                "tokens cannot be located (with any prepare.reasoning); fix: a chat_template.jinja in the verifier "
                "folder (verifier.model) that renders the turns before a reply unchanged"
            )
        turns.append((through, len(before), len(through)))
    return turns


def _tokens_with_mask(tokenizer: Any, text: str, spans: list[tuple[int, int]], max_len: int, eot_ids: set[int]
                      ) -> PreparedRow:
    """Tokenises ``text``; a token is an assistant token when it lies wholly inside one of ``spans``, and within
    each span tokens after the last end-of-turn token (template text such as a trailing newline) are not."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids: list[int] = list(encoded["input_ids"])
    offsets: list[tuple[int, int]] = list(encoded["offset_mapping"])
    loss_mask = [0] * len(input_ids)
    starts = [start for start, _ in offsets]
    for span_start, span_end in spans:
        inside = []
        for t in range(bisect.bisect_left(starts, span_start), len(input_ids)):
            if offsets[t][1] > span_end:
                break
            inside.append(t)
        eot_positions = [t for t in inside if input_ids[t] in eot_ids]
        if eot_positions:  # the reply ends at its end-of-turn token; what follows is template text
            inside = [t for t in inside if t <= eot_positions[-1]]
        for t in inside:
            loss_mask[t] = 1
    truncated = len(input_ids) > max_len
    return PreparedRow(input_ids[:max_len], loss_mask[:max_len], truncated)


def render_rows(tokenizer: Any, messages: list[dict[str, str]], max_len: int, eot_ids: set[int],
                chat_kwargs: dict[str, Any] | None = None) -> list[PreparedRow]:
    """One conversation as training rows, with the loss mask on exactly the tokens the model generated.

    A template that renders history unchanged (each turn's rendering is a prefix of the whole conversation's)
    gives one row with every reply masked in. A template that rewrites history, as reasoning templates do when
    they drop the thinking of earlier turns, gives one row per reply: the reply rendered after exactly the
    context the model saw when writing it (so thinking kept in the last turn is trained on, and never shown
    in a later turn's context where the model would not have seen it).
    """
    turns = assistant_turn_spans(tokenizer, messages, chat_kwargs)
    if not turns:
        return []
    full = _render(tokenizer, messages, generation_prompt=False, chat_kwargs=chat_kwargs)
    if all(full.startswith(through) for through, _, _ in turns):
        return [_tokens_with_mask(tokenizer, full, [(a, b) for _, a, b in turns], max_len, eot_ids)]
    return [_tokens_with_mask(tokenizer, through, [(a, b)], max_len, eot_ids) for through, a, b in turns]


def first_user_turn(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The conversation up to and including its first user message (an evaluation prompt)."""
    for i, message in enumerate(messages):
        if message["role"] == "user":
            return messages[: i + 1]
    return []


def trim_conversation(messages: list[dict[str, str]], max_assistant_turns: int | None) -> list[dict[str, str]]:
    """The conversation up to its last kept assistant reply (at most ``max_assistant_turns`` of them).

    Turns after the last assistant reply teach nothing (mask 0) and cost extraction time. A reply as the
    very first message has no prompt, so it is context and not counted.
    """
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i > 0]
    if max_assistant_turns is not None:
        replies = replies[:max_assistant_turns]
    return messages[: replies[-1] + 1] if replies else messages[:1]


def _has_reply(messages: list[dict[str, str]]) -> bool:
    return any(m["role"] == "assistant" for m in messages[1:])


Regenerator = Callable[[list[list[dict[str, str]]]], tuple[list[list[dict[str, str]]], Any]]
# count -> (that many user prompts written by the verifier, stats): builtin:self-instruct
PromptWriter = Callable[[int], tuple[list[str], Any]]


def source_quotas(entries: list[Any], wanted: int | None) -> dict[str, int | None]:
    """Conversations to take from each source: ``wanted`` split by weight (largest remainder), None = all.

    Raises:
        ParamsError: when a source with a weight > 0 would get no conversation at all.
    """
    weighted = [(e.source, e.weight) for e in entries if e.weight > 0]
    if wanted is None:
        return {name: None for name, _ in weighted}
    total = sum(w for _, w in weighted)
    exact = [(name, wanted * w / total) for name, w in weighted]
    quotas = {name: int(share) for name, share in exact}
    by_remainder = sorted(exact, key=lambda item: item[1] - int(item[1]), reverse=True)
    for name, _ in by_remainder[: wanted - sum(quotas.values())]:
        quotas[name] += 1
    empty = [name for name, quota in quotas.items() if quota == 0]
    if empty:
        raise ParamsError(
            f"prepare.max_conversations = {wanted} gives {', '.join(empty)} no conversation at its weight; "
            "raise max_conversations or the weight, or set the weight to 0"
        )
    return quotas


@dataclass
class PickStats:
    """What picking the mix did, for metrics/prepare.json."""

    records_read: int = 0
    no_reply: int = 0
    per_source: dict[str, int] = field(default_factory=dict)
    prompts: Any = None


def pick_conversations(params: PrepareParams, prompt_writer: PromptWriter | None
                       ) -> tuple[list[Conversation], PickStats]:
    """The conversations of the mix, in training order, each trimmed to its kept replies.

    Each source is shuffled with ``prepare.seed`` and gives its first ``quota`` conversations that have a
    reply; generated prompts get an empty reply for regeneration to write. With several sources the union
    is shuffled again, so the validation split (the last rows) holds every kind.
    """
    quotas = source_quotas(params.source, params.max_conversations)
    picked: list[Conversation] = []
    stats = PickStats()
    for name, quota in quotas.items():
        chosen: list[Conversation] = []
        if name == SELF_INSTRUCT_SOURCE:
            if prompt_writer is None:
                raise ParamsError(f"prepare.source {name} needs the verifier (prepare.regenerate: true)")
            texts, stats.prompts = prompt_writer(quota or 0)
            stats.records_read += len(texts)
            chosen = [Conversation(origin=f"{name}:{i}", messages=[{"role": "user", "content": text},
                                                                   {"role": "assistant", "content": ""}])
                      for i, text in enumerate(texts)]
        else:
            conversations = read_source(name)
            stats.records_read += len(conversations)
            order = list(range(len(conversations)))
            random.Random(params.seed).shuffle(order)
            for i in order:
                if quota is not None and len(chosen) == quota:
                    break
                messages = trim_conversation(conversations[i].messages, params.max_assistant_turns)
                if _has_reply(messages):
                    chosen.append(Conversation(conversations[i].origin, messages))
                else:
                    stats.no_reply += 1
        if not chosen:
            raise InputFileError(f"prepare.source: {name} yielded no conversation with a user prompt and a reply")
        stats.per_source[name] = len(chosen)
        picked.extend(chosen)
    if len(quotas) > 1:
        random.Random(params.seed).shuffle(picked)
    return picked, stats


def prepare_dataset(params: PrepareParams, tokenizer: Any, out_dir: Path, metrics_path: Path,
                    eot_ids: set[int], regenerator: Regenerator | None = None,
                    prompt_writer: PromptWriter | None = None) -> dict[str, Any]:
    """The prepare stage: read the mix, regenerate, render, mask, split and write; returns the metrics."""
    from tqdm import tqdm

    names = params.source_names
    imported = [s for s in names if s.startswith(IMPORT_PREFIX)]
    if imported:
        if len(names) != 1:
            raise ParamsError(
                f"prepare.source = {names}: an '{IMPORT_PREFIX}' source must be the only one "
                "(its rows are matched to imported hidden states by position)"
            )
        return prepare_imported(params, Path(imported[0].removeprefix(IMPORT_PREFIX)), out_dir, metrics_path)

    if not getattr(tokenizer, "is_fast", False):
        raise EaglenestError("the verifier's tokenizer has no fast (Rust) version; prepare needs its offsets")
    if template_handles_reasoning(tokenizer) and params.reasoning is None:
        raise ParamsError(
            f"prepare.reasoning is unset, but the chat template of {getattr(tokenizer, 'name_or_path', 'the verifier')}"
            " handles reasoning (<think> blocks); set prepare.reasoning: keep (train on the thinking tokens as well) "
            "or strip (answers only, rendered and regenerated with thinking off)"
        )
    chat_kwargs = chat_template_kwargs(params.reasoning)
    started = time.perf_counter()
    conversations, picks = pick_conversations(params, prompt_writer)
    if params.reasoning == "strip":
        conversations = [Conversation(c.origin, without_reasoning(c.messages)) for c in conversations]
    prompt_stats = picks.prompts
    regeneration = None
    if regenerator is not None:
        # Regenerate exactly the conversations that will be kept, before rendering, so no original reply slips in.
        regenerated, regeneration = regenerator([c.messages for c in conversations])
        conversations = [Conversation(origin=c.origin, messages=m)
                         for c, m in zip(conversations, regenerated, strict=True)]
    dropped: Counter[str] = Counter({reason: 0 for reason in DROP_REASONS})
    dropped["no_assistant_turn"] = picks.no_reply
    kept: list[tuple[list[PreparedRow], Conversation]] = []
    rendered = 0
    for conversation in tqdm(conversations, desc="prepare", unit="conv"):
        rendered += 1
        rows_of_conversation = [row for row in render_rows(tokenizer, conversation.messages, params.max_len, eot_ids,
                                                           chat_kwargs) if sum(row.loss_mask) > 0]
        if not rows_of_conversation:
            dropped["no_assistant_tokens_after_truncation"] += 1
            continue
        kept.append((rows_of_conversation, conversation))

    if len(kept) < 2:
        raise EaglenestError(
            f"prepare kept {len(kept)} of {rendered} conversations from {names}; need at least 2 "
            f"(one train, one validation). Dropped: {dict(dropped)}"
        )
    # Split by conversation: the rows of one conversation (one per reply, for templates that rewrite history)
    # must not land on both sides.
    train_conversations = _train_rows(len(kept), params.val_fraction)
    rows = [row for rows_of_conversation, _ in kept for row in rows_of_conversation]
    train_rows = sum(len(rows_of_conversation) for rows_of_conversation, _ in kept[:train_conversations])
    prompts = [{"messages": first_user_turn(conv.messages), "origin": conv.origin}
               for _, conv in kept[train_conversations:]]
    write_prepared(out_dir, [r.input_ids for r in rows], [r.loss_mask for r in rows], train_rows, prompts,
                   chat_kwargs)
    metrics = {
        "records_read": picks.records_read,
        "conversations_rendered": rendered,
        "picked_per_source": picks.per_source,
        "kept": len(kept),
        "rows": len(rows),
        "train_rows": train_rows,
        "val_rows": len(rows) - train_rows,
        "dropped": dict(dropped),
        "truncated": sum(r.truncated for r in rows),
        **_token_counts([r.input_ids for r in rows], [r.loss_mask for r in rows]),
        "seconds": round(time.perf_counter() - started, 3),
        "regenerated_turns": regeneration.turns if regeneration else 0,
        "regenerated_tokens": regeneration.tokens if regeneration else 0,
        "regenerate_cache_hits": regeneration.cache_hits if regeneration else 0,
        "regenerate_tokens_per_s": (round(regeneration.tokens / regeneration.seconds, 1)
                                    if regeneration and regeneration.tokens else None),
        "prompts_written": prompt_stats.written if prompt_stats else 0,
        "prompts_tried": prompt_stats.tried if prompt_stats else 0,
        "prompts_unfinished": prompt_stats.unfinished if prompt_stats else 0,
        "prompts_duplicate": prompt_stats.duplicates if prompt_stats else 0,
        "prompt_cache_hits": prompt_stats.cache_hits if prompt_stats else 0,
        "prompt_tokens_per_s": (round(prompt_stats.tokens / prompt_stats.seconds, 1)
                                if prompt_stats and prompt_stats.tokens and prompt_stats.seconds else None),
    }
    atomic_write_json(metrics_path, metrics)
    log.info("kept %d of %d conversations (%d tokens, %d loss tokens) -> %s",
             len(rows), rendered, metrics["tokens"], metrics["loss_tokens"], out_dir)
    return metrics


def _train_rows(kept: int, val_fraction: float) -> int:
    val_rows = max(1, round(kept * val_fraction))
    if kept - val_rows < 1:
        raise EaglenestError(f"prepare.val_fraction = {val_fraction} leaves no training rows of {kept}")
    return kept - val_rows


def _token_counts(input_ids: list[list[int]], loss_mask: list[list[int]]) -> dict[str, Any]:
    tokens = sum(len(ids) for ids in input_ids)
    return {"tokens": tokens, "loss_tokens": sum(sum(m) for m in loss_mask),
            "mean_seq_len": round(tokens / len(input_ids), 2)}


def prepare_imported(params: PrepareParams, source: Path, out_dir: Path, metrics_path: Path) -> dict[str, Any]:
    """Takes rows of an existing prepare-data dataset (``eaglenest import`` output, or speculators') in order.

    Order is kept, and nothing is dropped or truncated, because row ``i`` must stay row ``i`` of the imported
    hidden states. ``prepare.max_conversations`` takes the first N rows.
    """
    from datasets import load_from_disk

    started = time.perf_counter()
    try:
        table = load_from_disk(str(source)).data
    except FileNotFoundError:
        raise InputFileError(
            f"prepare.source: {source} is not a dataset folder (`eaglenest import` writes one)"
        ) from None
    missing = {"input_ids", "loss_mask"} - set(table.column_names)
    if missing:
        raise InputFileError(f"{source}: dataset lacks column(s) {sorted(missing)}; has {table.column_names}")
    count = min(params.max_conversations or table.num_rows, table.num_rows)
    input_ids = table.column("input_ids").to_pylist()[:count]
    loss_mask = table.column("loss_mask").to_pylist()[:count]
    for row, (ids, mask) in enumerate(zip(input_ids, loss_mask, strict=True)):
        if len(ids) != len(mask):
            raise InputFileError(f"{source}: row {row}: {len(ids)} input_ids but {len(mask)} loss_mask values")
        if len(ids) > params.max_len:
            raise InputFileError(
                f"{source}: row {row} has {len(ids)} tokens > prepare.max_len = {params.max_len}; imported rows "
                "are never truncated (their hidden states would no longer match): raise prepare.max_len"
            )
    if count < 2:
        raise EaglenestError(f"{source}: {count} rows; need at least 2 (one train, one validation)")
    train_rows = _train_rows(count, params.val_fraction)
    write_prepared(out_dir, input_ids, loss_mask, train_rows, [])
    metrics = {
        "records_read": table.num_rows,
        "conversations_rendered": 0,
        "kept": count,
        "train_rows": train_rows,
        "val_rows": count - train_rows,
        "dropped": {reason: 0 for reason in DROP_REASONS},
        "truncated": 0,
        **_token_counts(input_ids, loss_mask),
        "seconds": round(time.perf_counter() - started, 3),
    }
    atomic_write_json(metrics_path, metrics)
    return metrics


