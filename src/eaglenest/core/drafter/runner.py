"""The drafter attached to one vLLM model runner: every step, per request, a suffix continuation, the draft's, or
none; and the positions the draft has not seen yet, kept until it next drafts for that request.

How the draft's KV cache stays exact. vLLM's EAGLE proposer starts every proposal with a *first pass*: the draft
over the positions the verifier took this step (for position ``p``: the token at ``p + 1`` and the verifier's hidden
states at ``p``), written into the draft's cache through the verifier's KV slots. Here a request's first-pass
entries (token, position, hidden states, slot) are collected every step into :class:`Unseen`; when the request next
needs a draft proposal, all of them, old and new, go through one first pass (:meth:`Drafter.run_draft`), so every
position reaches the draft's cache exactly once and before any proposal that attends to it, whether the steps
between drafted with suffix decoding, drafted nothing (K = 0), or the request was still in prefill. A request only
the suffix drafter served, or none, costs the draft nothing that step. Slots stay valid while a request runs: its
blocks are its own until it finishes, and a preempted request is recomputed from its start, which drops what it had
kept (prefix caching, which could hand a request blocks another computed, is off in every engine eaglenest starts).

Where ``at_zero`` is ``retire``, a step whose schedule gives K = 0 instead ends drafting with the draft for every
request in it, for the rest of their lives: nothing kept, nothing caught up.

What it needs from vLLM 0.32's runner (checked by :func:`attach`): the EAGLE-3 proposer on the list path
(``disable_padded_drafter_batch``: proposing after the step's tokens are booked, from lists of accepted tokens),
greedy draft sampling, and the aux hidden states the runner hands its proposer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from eaglenest.core.drafter.config import DrafterConfig

TRACE_ENV = "EAGLENEST_DRAFTER_TRACE"  # a file: one JSON line per proposal (tests and benchmarks read it)


@dataclass
class Unseen:
    """One request's positions the draft has not taken yet, oldest first: the first pass's inputs for each."""

    token_ids: list[torch.Tensor] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)
    slots: list[torch.Tensor] = field(default_factory=list)
    count: int = 0

    def add(self, token_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, slots: torch.Tensor) -> None:
        """Keeps one step's entries (slices of the step's own copies, :meth:`Drafter._step_entries`)."""
        if token_ids.numel() == 0:
            return
        self.token_ids.append(token_ids)
        self.positions.append(positions)
        self.hidden.append(hidden)
        self.slots.append(slots)
        self.count += int(token_ids.numel())

    def joined(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """All entries, in one tensor each."""
        return (torch.cat(self.token_ids), torch.cat(self.positions), torch.cat(self.hidden), torch.cat(self.slots))


@dataclass
class Feed:
    """One request's share of a draft forward: its entries, its row in the runner's batch, and the token after its
    last entry (the first pass's input at that position)."""

    row: int
    token_ids: torch.Tensor
    positions: torch.Tensor
    hidden: torch.Tensor
    slots: torch.Tensor
    next_token: int


@dataclass
class Counts:
    """What the drafter did, summed over an engine's life (read by measurements through ``collective_rpc``)."""

    steps: int = 0
    draft_forwards: int = 0  # first passes run (each may carry several requests)
    fed_positions: int = 0  # positions the first passes took
    caught_up: int = 0  # of these, positions kept from earlier steps
    draft_proposals: int = 0  # request-steps the draft proposed for
    suffix_proposals: int = 0  # request-steps suffix decoding proposed for
    retired: int = 0  # requests the draft stopped drafting for (at_zero: retire)


class Drafter:
    """The drafter's state for one model runner: what each request has left unseen, the suffix tree, counts."""

    def __init__(self, runner: Any, config: DrafterConfig) -> None:
        self.runner = runner
        self.counts = Counts()
        self.unseen: dict[str, Unseen] = {}
        self.retired: set[str] = set()
        self.trace_path = os.environ.get(TRACE_ENV) or None
        self.configure(config)

    def configure(self, config: DrafterConfig) -> None:
        """Takes ``config`` (at start, or between requests through ``collective_rpc``: :func:`reconfigure`)."""
        if config.max_k > self.runner.num_spec_tokens:
            raise RuntimeError(
                f"eaglenest drafter: K {config.max_k} exceeds the engine's num_speculative_tokens "
                f"{self.runner.num_spec_tokens}"
            )
        self.config = config
        tree = None if config.suffix is None else (config.suffix.max_tree_depth, config.suffix.max_cached_requests)
        if tree is None:
            self.suffix_cache, self.suffix_tree = None, None
        elif tree != getattr(self, "suffix_tree", None):
            # a new tree only where its shape changes: the finished requests it holds are what it drafts from
            try:
                from arctic_inference.suffix_decoding import SuffixDecodingCache
            except ImportError:
                raise RuntimeError(SUFFIX_MISSING) from None
            self.suffix_cache = SuffixDecodingCache(max_tree_depth=tree[0], max_cached_requests=tree[1])
            self.suffix_tree = tree

    def forget_suffix_tree(self) -> None:
        """Starts suffix decoding's tree afresh, holding no finished request (between requests only)."""
        self.suffix_tree = None
        self.configure(self.config)

    # --- one step ------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(
        self,
        scheduler_output: Any,
        sampled_token_ids: list[list[int]],
        sampling_metadata: Any,
        hidden_states: torch.Tensor,
        sample_hidden_states: torch.Tensor,
        aux_hidden_states: list[torch.Tensor] | None,
        spec_decode_metadata: Any,
        common_attn_metadata: Any,
        slot_mappings: Any,
    ) -> list[list[int]]:
        """``GPUModelRunner.propose_draft_token_ids`` for this runner: each request's proposal (lists of any length
        up to the step's K; the scheduler trims and pads them)."""
        runner, batch, config = self.runner, self.runner.input_batch, self.config
        req_ids: list[str] = list(batch.req_ids)
        # vLLM's K for this batch size (its schedule); none while paused
        k_step = 0 if config.paused else scheduler_output.num_spec_tokens_to_schedule
        self.counts.steps += 1
        self._forget_finished(req_ids)
        entries = self._step_entries(
            scheduler_output, sampled_token_ids, aux_hidden_states, spec_decode_metadata, common_attn_metadata
        )
        next_tokens = runner.drafter.prepare_next_token_ids_cpu(
            sampled_token_ids, runner.requests, batch, scheduler_output.num_scheduled_tokens
        ).tolist()
        if k_step == 0 and config.at_zero == "retire":
            newly = set(req_ids) - self.retired
            self.counts.retired += len(newly)
            self.retired |= newly
        proposals: list[list[int]] = [[] for _ in req_ids]
        wants_draft: list[int] = []
        max_model_len = runner.max_model_len
        for row, req_id in enumerate(req_ids):
            sampled = sampled_token_ids[row]
            num_tokens = int(batch.num_tokens_no_spec[row])
            if self.suffix_cache is not None and sampled:
                self._suffix_add(row, req_id, sampled)
            # a partial prefill proposes nothing; nor a request whose proposal would pass the context
            if not sampled or k_step == 0 or num_tokens + config.max_k + 1 > max_model_len:
                continue
            if self.suffix_cache is not None and config.suffix is not None:
                suffix = self._suffix_speculate(row, req_id, num_tokens, min(config.suffix.k, k_step))
                if suffix is not None:
                    proposals[row] = suffix
                    continue
            if req_id not in self.retired:
                wants_draft.append(row)
        draft_k = min(config.draft_k, k_step)
        feeds: list[tuple[int, str]] = []
        overfull: list[tuple[int, str]] = []
        for row, req_id in enumerate(req_ids):
            if req_id in self.retired:
                self.unseen.pop(req_id, None)
                continue
            unseen = self._unseen_of(req_id, entries[row][1])
            unseen.add(*entries[row])
            if row in wants_draft or unseen.count > config.max_pending_tokens:
                (feeds if row in wants_draft else overfull).append((row, req_id))
        if feeds or overfull:
            drafted = self.run_draft(feeds, overfull, next_tokens, draft_k, common_attn_metadata, sampling_metadata)
            for row, tokens in drafted.items():
                proposals[row] = tokens
        if self.trace_path:
            self._trace(req_ids, proposals, wants_draft, batch)
        return proposals

    def _step_entries(
        self,
        scheduler_output: Any,
        sampled_token_ids: list[list[int]],
        aux_hidden_states: list[torch.Tensor] | None,
        spec_decode_metadata: Any,
        common_attn_metadata: Any,
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per row of the batch, this step's first-pass entries (tokens, positions, hidden states, slots): the
        positions the verifier took, its rejected drafts left out, selected as vLLM's own list path selects them.
        Each is a slice of one copy per step (the runner rewrites its buffers every step)."""
        runner, drafter = self.runner, self.runner.drafter
        if aux_hidden_states is None:
            raise RuntimeError(
                "eaglenest drafter: the verifier handed no aux hidden states (an EAGLE-3 draft needs them)"
            )
        if spec_decode_metadata is None:
            cad = common_attn_metadata
            total = scheduler_output.total_num_scheduled_tokens
            token_ids = runner.input_ids.gpu[:total].clone()
            positions = runner._get_positions(total).clone()
            hidden = torch.cat([h[:total] for h in aux_hidden_states], dim=-1)
            slots = cad.slot_mapping[:total].clone()
        else:
            cad, indices = drafter.prepare_inputs(
                common_attn_metadata, sampled_token_ids, spec_decode_metadata.num_draft_tokens
            )
            token_ids = runner.input_ids.gpu[indices]
            positions = runner._get_positions(indices)
            hidden = torch.cat([h[indices] for h in aux_hidden_states], dim=-1)
            slots = cad.slot_mapping  # indexed by prepare_inputs: its own tensor
        starts = cad.query_start_loc_cpu.tolist()
        return [
            (token_ids[a:b], positions[a:b], hidden[a:b], slots[a:b])
            for a, b in zip(starts[:-1], starts[1:], strict=True)
        ]

    def _unseen_of(self, req_id: str, positions: torch.Tensor) -> Unseen:
        """The request's kept entries; dropped first where this step starts at or before the last kept position
        (the request was preempted and is computed again from its start)."""
        unseen = self.unseen.get(req_id)
        restarted = unseen is not None and unseen.count and positions.numel()
        if restarted and unseen is not None and int(positions[0]) <= int(unseen.positions[-1][-1]):
            unseen = None
        if unseen is None:
            unseen = self.unseen[req_id] = Unseen()
        return unseen

    def _forget_finished(self, req_ids: list[str]) -> None:
        """Drops what finished requests kept, and stops them in the suffix tree (it keeps their output)."""
        live = set(req_ids)
        for req_id in [r for r in self.unseen if r not in live]:
            del self.unseen[req_id]
        self.retired &= live
        if self.suffix_cache is not None:
            for req_id in list(self.suffix_cache.active_requests - live):
                self.suffix_cache.stop_request(req_id)

    # --- the draft -----------------------------------------------------------------------------------------------
    def run_draft(
        self,
        wanted: list[tuple[int, str]],
        overfull: list[tuple[int, str]],
        next_tokens: list[int],
        k: int,
        common_attn_metadata: Any,
        sampling_metadata: Any,
    ) -> dict[int, list[int]]:
        """Feeds every entry the ``wanted`` and ``overfull`` requests kept to the draft, proposing ``k`` tokens for
        the ``wanted`` ones; returns row -> proposal. A forward takes at most what the proposer's buffers hold
        (``max_num_tokens``): a request's entries beyond it go first, in forwards that propose nothing (K = 0, the
        first pass alone), oldest first."""
        capacity = self.runner.drafter.max_num_tokens
        heads: list[Feed] = []
        tails: list[Feed] = []
        for row, req_id in wanted + overfull:
            unseen = self.unseen.pop(req_id)
            token_ids, positions, hidden, slots = unseen.joined()
            self.counts.caught_up += unseen.count - int(unseen.token_ids[-1].numel())
            n = int(token_ids.numel())
            last = max(0, n - capacity)  # the last piece: at most a whole forward
            for start in range(0, last, capacity):
                end = min(last, start + capacity)
                heads.append(
                    Feed(
                        row,
                        token_ids[start:end],
                        positions[start:end],
                        hidden[start:end],
                        slots[start:end],
                        int(token_ids[end]),
                    )
                )
            tails.append(Feed(row, token_ids[last:], positions[last:], hidden[last:], slots[last:], next_tokens[row]))
        for group in _groups(heads, capacity):
            self._forward(group, 0, common_attn_metadata, sampling_metadata)
        wanted_rows = {row for row, _ in wanted}
        proposals: dict[int, list[int]] = {}
        for group in _groups(tails, capacity):
            drafted = self._forward(group, k, common_attn_metadata, sampling_metadata).tolist()
            for feed, tokens in zip(group, drafted, strict=True):
                if feed.row in wanted_rows:
                    proposals[feed.row] = tokens
        self.counts.draft_proposals += len(proposals)
        return proposals

    def _forward(self, feeds: list[Feed], k: int, common_attn_metadata: Any, sampling_metadata: Any) -> torch.Tensor:
        """One draft forward over ``feeds`` (each its request's entries, in position order), through vLLM's own
        EAGLE proposer: the first pass, then ``k`` proposed tokens per request (none at k = 0)."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        drafter = self.runner.drafter
        device = drafter.input_ids.device
        lengths = torch.tensor([f.token_ids.numel() for f in feeds], dtype=torch.int32)
        query_start = torch.zeros(len(feeds) + 1, dtype=torch.int32)
        torch.cumsum(lengths, 0, out=query_start[1:])
        seq_lens = torch.tensor([int(f.positions[-1]) + 1 for f in feeds], dtype=torch.int32)
        rows = torch.tensor([f.row for f in feeds], dtype=torch.long, device=device)
        cad = CommonAttentionMetadata(
            query_start_loc=query_start.to(device),
            query_start_loc_cpu=query_start,
            seq_lens=seq_lens.to(device),
            seq_lens_cpu_upper_bound=seq_lens,
            num_reqs=len(feeds),
            num_actual_tokens=int(query_start[-1]),
            max_query_len=int(lengths.max()),
            max_seq_len=int(seq_lens.max()),
            block_table_tensor=common_attn_metadata.block_table_tensor[rows],
            slot_mapping=torch.cat([f.slots for f in feeds]),
            causal=True,
        )
        self.counts.draft_forwards += 1
        self.counts.fed_positions += int(query_start[-1])
        return drafter.propose(
            num_speculative_tokens=k,
            target_token_ids=torch.cat([f.token_ids for f in feeds]),
            target_positions=torch.cat([f.positions for f in feeds]),
            target_hidden_states=torch.cat([f.hidden for f in feeds]),
            next_token_ids=torch.tensor([f.next_token for f in feeds], dtype=torch.int32, device=device),
            token_indices_to_sample=None,
            common_attn_metadata=cad,
            sampling_metadata=sampling_metadata,
            mm_embed_inputs=None,
            num_rejected_tokens_gpu=None,
            slot_mappings=None,
        )

    # --- suffix decoding (as vLLM's SuffixDecodingProposer feeds Arctic Inference's cache) ----------------------
    def _suffix_add(self, row: int, req_id: str, sampled: list[int]) -> None:
        """This step's accepted tokens into the request's suffix tree (started from its prompt when new)."""
        cache: Any = self.suffix_cache
        batch = self.runner.input_batch
        if req_id not in cache.active_requests:
            if req_id in cache.cached_requests:
                cache.evict_cached_response(req_id)
            index = batch.req_id_to_index[req_id]
            cache.start_request(req_id, batch.token_ids_cpu[index, : batch.num_prompt_tokens[index]])
        cache.add_active_response(req_id, sampled)

    def _suffix_speculate(self, row: int, req_id: str, num_tokens: int, k: int) -> list[int] | None:
        """The suffix continuation of the request's last tokens where its score reaches the threshold, else None."""
        suffix, batch = self.config.suffix, self.runner.input_batch
        cache: Any = self.suffix_cache
        assert suffix is not None  # called only in a hybrid
        pattern = batch.token_ids_cpu[row, max(0, num_tokens - suffix.max_tree_depth) : num_tokens]
        draft = cache.speculate(
            req_id,
            pattern,
            max_spec_tokens=min(k, self.runner.max_model_len - num_tokens - 1),
            max_spec_factor=suffix.max_spec_factor,
            min_token_prob=suffix.min_token_prob,
        )
        if not draft.token_ids or draft.score < suffix.threshold:
            return None
        self.counts.suffix_proposals += 1
        return list(draft.token_ids)

    def _trace(self, req_ids: list[str], proposals: list[list[int]], drafted: list[int], batch: Any) -> None:
        """One JSON line per proposal: the request, its length so far, who proposed, the tokens."""
        assert self.trace_path is not None  # called only where tracing is on
        with open(self.trace_path, "a", encoding="utf-8") as f:
            for row, req_id in enumerate(req_ids):
                if proposals[row]:
                    source = "draft" if row in drafted else "suffix"
                    line = {
                        "req": req_id,
                        "num_tokens": int(batch.num_tokens_no_spec[row]),
                        "source": source,
                        "tokens": proposals[row],
                    }
                    f.write(json.dumps(line) + "\n")


def _groups(feeds: list[Feed], capacity: int) -> list[list[Feed]]:
    """``feeds`` in order, grouped so that no group's entries pass ``capacity`` and no group holds one request
    twice (a request's chunks go in separate forwards, oldest first)."""
    groups: list[list[Feed]] = []
    current: list[Feed] = []
    size = 0
    for feed in feeds:
        n = feed.token_ids.numel()
        if current and (size + n > capacity or any(f.row == feed.row for f in current)):
            groups.append(current)
            current, size = [], 0
        current.append(feed)
        size += n
    if current:
        groups.append(current)
    return groups


SUFFIX_MISSING = (
    "eaglenest drafter: the hybrid needs suffix decoding (arctic_inference.suffix_decoding), and arctic-inference is "
    "not installed: `make setup` builds it from its sdist (docs/install.md)"
)


def attach(runner: Any, config: DrafterConfig) -> None:
    """Puts the drafter on ``runner`` (a vLLM 0.32 ``GPUModelRunner`` or its CPU subclass), after checking that the
    runner drafts the way the drafter needs.

    Raises:
        RuntimeError: one line naming the setting that does not fit.
    """
    spec = runner.speculative_config
    problems = []
    if spec is None or spec.method != "eagle3":
        problems.append(f"speculative_config.method must be eagle3 (is {getattr(spec, 'method', None)})")
    elif not spec.disable_padded_drafter_batch:
        problems.append("speculative_config.disable_padded_drafter_batch must be true (the drafter's list path)")
    elif spec.draft_sample_method != "greedy":
        problems.append(f"speculative_config.draft_sample_method must be greedy (is {spec.draft_sample_method})")
    if problems:
        raise RuntimeError("eaglenest drafter: " + "; ".join(problems))
    drafter = Drafter(runner, config)
    runner._eaglenest_drafter = drafter
    runner.propose_draft_token_ids = drafter.propose
    # vLLM skips its proposer for the whole batch where any request is near the end of its context; the drafter
    # decides that per request (a request near its end proposes nothing, the others keep their positions).
    runner._input_fits_in_drafter = lambda cad: cad is not None
    runner._sample = _plain_sampling_without_drafts(runner)


def _plain_sampling_without_drafts(runner: Any) -> Any:
    """The runner's ``_sample``, but a step in which no request verifies a draft samples as a plain engine does.

    vLLM sends every step of a drafting engine through its rejection sampler, drafts or not; with none it samples the
    bonus token from the same logits with the same sampler and generators, around a dozen more small operations per
    step. A step with no drafts is the step a schedule's K = 0 gives at every batch size past it, so that cost would
    be paid at every load where speculation stops. Steps that ask for log-probs keep vLLM's own path (it computes
    them its own way)."""
    original = runner._sample

    def _sample(logits: Any, spec_decode_metadata: Any) -> Any:
        if (
            spec_decode_metadata is not None
            and spec_decode_metadata.max_spec_len == 0
            and runner.input_batch.sampling_metadata.max_num_logprobs is None
        ):
            return runner.sampler(logits=logits, sampling_metadata=runner.input_batch.sampling_metadata)
        return original(logits, spec_decode_metadata)

    return _sample


def reconfigure(worker: Any, config: dict) -> None:
    """``llm.collective_rpc(reconfigure, args=(config,))``: the drafter of a running engine takes ``config`` (a
    :class:`DrafterConfig` as a dict) for the requests it starts next (measurements time several settings on one
    engine)."""
    worker.model_runner._eaglenest_drafter.configure(DrafterConfig.model_validate(config))


def forget_suffix_tree(worker: Any) -> None:
    """``llm.collective_rpc(forget_suffix_tree)``: the drafter's suffix tree starts afresh, so that requests decoded
    next match none decoded before (a measurement that decodes the same prompts again, timed, must not find their
    earlier outputs)."""
    worker.model_runner._eaglenest_drafter.forget_suffix_tree()


def counts(worker: Any) -> dict:
    """``llm.collective_rpc(counts)``: what the engine's drafter did so far (:class:`Counts`)."""
    return dict(vars(worker.model_runner._eaglenest_drafter.counts))
