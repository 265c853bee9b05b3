"""EAGLE-3 chain speculative decoding with a transformers verifier: the reference implementation.

One round ("verify step"), with the verifier's KV cache covering the accepted tokens x_0..x_{n-1} and the
next token x_n already chosen by the verifier:

1. The draft proposes K tokens d_1..d_K after x_n. Its input at a verified position t is
   [embed(x_{t+1}); fc(aux_t)] (the verifier's aux hidden states at t); each further draft step feeds
   back [embed(d_k); h_k], the draft's own hidden state. Draft ids map to verifier ids through d2t.
2. The verifier runs once over [x_n, d_1..d_K] (K+1 positions) and yields K+1 distributions.
3. Greedy (temperature 0): accept the longest prefix of drafts equal to the verifier's argmax, then emit
   the verifier's own next token (the "bonus"). Sampling (temperature > 0): accept d_i with probability
   min(1, p(d_i)/q(d_i)), else sample from the normalised residual max(0, p - q) and stop; so the output
   is distributed exactly as the verifier's.
4. Both KV caches are cut back to the accepted tokens (rolled back on rejection).

Every round emits (accepted + 1) tokens for one verifier forward: the acceptance length tau, as vLLM
counts it (1 + accepted / drafts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import DynamicCache

from eaglenest.core.chat import cut_after_end_of_turn
from eaglenest.stages.evaluate.acceptance import Acceptance


def truncate_cache(cache: Any, length: int) -> None:
    """Keeps the first ``length`` positions of a transformers cache."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


class VerifierRunner:
    """The verifier with a KV cache, returning logits and the aux hidden states of every new position."""

    def __init__(self, model: Any, aux_layers: list[int]) -> None:
        self.model = model
        self.aux_layers = aux_layers
        self.cache = DynamicCache()

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def reset(self) -> None:
        self.cache = DynamicCache()

    @torch.inference_mode()
    def extend(self, tokens: list[int], want_aux: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Appends ``tokens``; returns logits ``[len, V]`` and aux states ``[len, n_aux, H]`` (or None)."""
        ids = torch.tensor([tokens], dtype=torch.long)
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, output_hidden_states=want_aux)
        self.cache = out.past_key_values
        aux = torch.stack([out.hidden_states[layer][0] for layer in self.aux_layers], dim=1) if want_aux else None
        return out.logits[0].float(), aux

    def truncate(self, length: int) -> None:
        truncate_cache(self.cache, length)


class Drafter(Protocol):
    """Proposes draft tokens; told what the verifier accepted."""

    def start(self, prompt: list[int], aux: torch.Tensor, next_token: int) -> None:
        """A new sequence: the prompt, its aux states ``[n, n_aux, H]`` and the verifier's next token."""

    def propose(
        self, k: int, temperature: float, generator: torch.Generator | None
    ) -> tuple[list[int], list[torch.Tensor] | None]:
        """Up to ``k`` verifier-vocabulary tokens, with their proposal distributions when sampling."""

    def accept(self, tokens: list[int], aux: torch.Tensor, next_token: int) -> None:
        """``tokens`` joined the sequence (with aux states ``[len, n_aux, H]``); ``next_token`` follows."""


class EagleDrafter:
    """A trained EAGLE-3 draft (speculators' Eagle3DraftModel) run step by step with its own KV cache."""

    def __init__(self, model: Any, verifier_vocab_size: int) -> None:
        self.model = model.eval()
        self.vocab = verifier_vocab_size
        d2t = getattr(model, "d2t", None)
        draft_vocab = model.lm_head.weight.shape[0]
        self.draft_to_target = torch.arange(draft_vocab) + (d2t if d2t is not None else 0)

    def _layer_pass(self, embeds_and_hidden: torch.Tensor, first_position: int) -> torch.Tensor:
        """Runs the draft decoder over new positions, appending to its cache; returns pre-norm hidden."""
        n_new = embeds_and_hidden.shape[1]
        past = self.cache.get_seq_length()
        position_ids = torch.arange(first_position, first_position + n_new).unsqueeze(0)
        cache_position = torch.arange(past, past + n_new)
        # Causal over the cache: new query i sees every cached key and new keys 0..i.
        allowed = torch.arange(past + n_new).unsqueeze(0) <= (past + torch.arange(n_new)).unsqueeze(1)
        mask = torch.zeros(1, 1, n_new, past + n_new).masked_fill(~allowed, float("-inf"))
        position_embeddings = self.model.rotary_emb(embeds_and_hidden, position_ids)
        hidden = embeds_and_hidden
        for layer in self.model.layers:
            hidden = layer(
                hidden,
                attention_mask=mask,
                position_ids=position_ids,
                past_key_values=self.cache,
                cache_position=cache_position,
                position_embeddings=position_embeddings,
                use_cache=True,
            )
        return hidden

    def _output(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layer output as the draft feeds it back: normed first with EAGLE-3.1's norm_output, as
        speculators trains it (the LM head then reads it without a second norm)."""
        return self.model.norm(hidden) if self.model.config.norm_output else hidden

    def _feed_verified(self, tokens_after: list[int], aux: torch.Tensor) -> None:
        """Positions whose aux states the verifier produced: input [embed(x_{t+1}); fc(aux_t)]."""
        with torch.inference_mode():
            aux = aux.flatten(1).unsqueeze(0).to(self.model.fc.weight.dtype)  # [1, n, num_aux * H]
            if self.model.input_norm is not None:  # EAGLE-3.1's norm_before_fc
                aux = self.model.input_norm(aux)
            g = self.model.fc(aux)  # [1, n, H]
            embeds = self.model.embed_tokens(torch.tensor([tokens_after]))  # [1, n, H]
            # Position ids follow training (speculators' shift_batch): verified position t has id t + 1.
            hidden = self._layer_pass(torch.cat([embeds, g], dim=-1), self.verified + 1)
        self.verified += len(tokens_after)
        self.last_hidden = self._output(hidden)[:, -1:]

    def start(self, prompt: list[int], aux: torch.Tensor, next_token: int) -> None:
        self.cache = DynamicCache()
        self.verified = 0
        self._feed_verified(prompt[1:] + [next_token], aux)

    def propose(
        self, k: int, temperature: float, generator: torch.Generator | None
    ) -> tuple[list[int], list[torch.Tensor] | None]:
        tokens: list[int] = []
        dists: list[torch.Tensor] = []
        hidden = self.last_hidden
        with torch.inference_mode():
            for step in range(k):
                if step > 0:  # feed back [embed(d_step); h_step]
                    embeds = self.model.embed_tokens(torch.tensor([[tokens[-1]]]))
                    hidden = self._output(self._layer_pass(torch.cat([embeds, hidden], dim=-1), self.verified + step))
                logits = self.model.lm_head(hidden if self.model.config.norm_output else self.model.norm(hidden))[
                    0, -1
                ].float()  # [draft_vocab]
                if temperature == 0:
                    draft_id = int(torch.argmax(logits))
                else:
                    q_draft = torch.softmax(logits / temperature, dim=-1)
                    draft_id = int(torch.multinomial(q_draft, 1, generator=generator))
                    q = torch.zeros(self.vocab)
                    q[self.draft_to_target] = q_draft
                    dists.append(q)
                tokens.append(int(self.draft_to_target[draft_id]))
        # Speculative entries leave the cache: only verified positions stay.
        truncate_cache(self.cache, self.verified)
        return tokens, (dists if temperature > 0 else None)

    def accept(self, tokens: list[int], aux: torch.Tensor, next_token: int) -> None:
        self._feed_verified(tokens[1:] + [next_token], aux)


@dataclass
class DecodeResult:
    """One prompt's speculative decoding: its output, its acceptance counts and its wall time."""

    tokens: list[int]
    acceptance: Acceptance
    seconds: float = 0.0


def _sample(p: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=generator))


def speculative_decode(
    verifier: VerifierRunner,
    drafter: Drafter,
    prompt: list[int],
    k: int,
    max_new_tokens: int,
    eos_ids: set[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> DecodeResult:
    """Generates up to ``max_new_tokens`` after ``prompt`` with chain speculative decoding."""
    started = time.perf_counter()
    verifier.reset()
    logits, aux = verifier.extend(prompt)
    next_token = _choose(logits[-1], temperature, generator)
    drafter.start(prompt, aux, next_token)
    result = DecodeResult(tokens=[next_token], acceptance=Acceptance(k))
    finished = next_token in eos_ids
    while len(result.tokens) < max_new_tokens and not finished:
        # Always K drafts, even when fewer tokens are left to emit: vLLM does the same and counts every
        # accepted draft, also those past max_new_tokens, so tau and per-position acceptance compare.
        # The output is cut below.
        drafts, q = drafter.propose(k, temperature, generator)
        logits, aux = verifier.extend([next_token, *drafts])  # [len(drafts) + 1, V]
        accepted, bonus = _verify(drafts, q, logits, temperature, generator)
        result.acceptance.add_step(len(drafts), accepted)
        kept = [next_token, *drafts[:accepted]]  # now in the verifier's cache for good
        verifier.truncate(verifier.length - (len(drafts) - accepted))
        new_tokens = drafts[:accepted] + [bonus]
        for token in new_tokens:
            result.tokens.append(token)
            # An accepted draft can be the end of turn: the reply ends there, as plain decoding's would.
            finished = token in eos_ids
            if finished or len(result.tokens) >= max_new_tokens:
                break
        next_token = bonus
        drafter.accept(kept, aux[: accepted + 1], bonus)
    result.tokens = cut_after_end_of_turn(result.tokens[:max_new_tokens], eos_ids)
    result.seconds = time.perf_counter() - started
    return result


def _choose(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if temperature == 0:
        return int(torch.argmax(logits))
    return _sample(torch.softmax(logits / temperature, dim=-1), generator)


def _verify(
    drafts: list[int],
    q: list[torch.Tensor] | None,
    logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """(number of drafts accepted, the verifier's token after them)."""
    if temperature == 0:
        targets = torch.argmax(logits, dim=-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
            accepted += 1
        return accepted, targets[accepted]
    assert q is not None
    p = torch.softmax(logits / temperature, dim=-1)
    for i, token in enumerate(drafts):
        ratio = p[i, token] / max(float(q[i][token]), 1e-20)
        if float(torch.rand(1, generator=generator)) < min(1.0, float(ratio)):
            continue
        residual = torch.clamp(p[i] - q[i], min=0)
        total = float(residual.sum())
        return i, _sample(residual / total if total > 0 else p[i], generator)
    return len(drafts), _sample(p[len(drafts)], generator)
