"""Speculative decoding: exact tau for oracle and always-wrong drafts, lossless with a trained draft,
and speculative sampling that preserves the verifier's distribution."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from eaglenest.evaluate import summarize
from eaglenest.speculative import (
    EagleDrafter,
    VerifierRunner,
    _verify,
    ngram_acceptance,
    plain_decode,
    speculative_decode,
)

K = 3
PROMPT = [5, 17, 42, 8, 99, 23, 7]


class ScriptedDrafter:
    """Proposes the verifier's own greedy continuation (oracle), or always a wrong token."""

    def __init__(self, reference: list[int], wrong: bool = False, vocab: int = 300) -> None:
        self.reference, self.wrong, self.vocab = reference, wrong, vocab

    def start(self, prompt, aux, next_token):
        assert aux.shape[0] == len(prompt)
        self.position = 0  # index of next_token in the reference output

    def propose(self, k, temperature, generator):
        truth = self.reference[self.position + 1 : self.position + 1 + k]
        return ([(t + 1) % self.vocab for t in truth] if self.wrong else truth), None

    def accept(self, tokens, aux, next_token):
        assert aux.shape[0] == len(tokens)
        self.position += len(tokens)


@pytest.fixture(scope="module")
def verifier(tiny_verifier_dir: Path) -> VerifierRunner:
    model = AutoModelForCausalLM.from_pretrained(tiny_verifier_dir, dtype=torch.float32).eval()
    return VerifierRunner(model, [1, 3, 5])


def test_oracle_draft_gives_tau_k_plus_one(verifier: VerifierRunner):
    max_new = 1 + 5 * (K + 1)
    reference, _ = plain_decode(verifier, PROMPT, max_new, eos_ids=set())
    result = speculative_decode(verifier, ScriptedDrafter(reference), PROMPT, K, max_new, eos_ids=set())
    assert result.tokens == reference
    metrics = summarize(K, result.verify_steps, result.accepted, result.accepted_per_position)
    assert metrics["tau"] == K + 1 and metrics["per_position_acceptance"] == [1.0] * K
    assert metrics["verify_steps"] == 5


def test_decoding_stops_when_an_accepted_draft_ends_the_turn(verifier: VerifierRunner):
    reference, _ = plain_decode(verifier, PROMPT, 12, eos_ids=set())
    eos = {reference[2]}  # the oracle's first round proposes reference[1..3]: the end of turn is accepted
    plain, _ = plain_decode(verifier, PROMPT, 12, eos_ids=eos)
    result = speculative_decode(verifier, ScriptedDrafter(reference), PROMPT, K, 12, eos_ids=eos)
    assert result.tokens == plain == reference[:3]
    assert result.verify_steps == 1  # no round is spent generating past the end of the reply


def test_always_wrong_draft_gives_tau_one(verifier: VerifierRunner):
    reference, _ = plain_decode(verifier, PROMPT, 12, eos_ids=set())
    result = speculative_decode(verifier, ScriptedDrafter(reference, wrong=True), PROMPT, K, 12, eos_ids=set())
    assert result.tokens == reference  # still lossless: every token is the verifier's own
    metrics = summarize(K, result.verify_steps, result.accepted, result.accepted_per_position)
    assert metrics["tau"] == 1.0 and metrics["draft_acceptance_rate"] == 0.0
    assert result.verify_steps == 11


def test_trained_draft_is_lossless_at_temperature_zero(verifier: VerifierRunner, tmp_path: Path,
                                                       tiny_verifier_dir: Path):
    from eaglenest.convert import convert
    from eaglenest.evaluate import load_draft
    from eaglenest.extract import extract_hidden_states
    from eaglenest.params import ConvertParams, ExtractParams, TrainParams
    from eaglenest.train import TrainInputs, train_draft

    from .test_extract import pipeline_until_prepare

    verifier_dir, prepared = pipeline_until_prepare(tmp_path, tiny_verifier_dir, rows=20)
    extract_hidden_states(ExtractParams(), verifier_dir, prepared, tmp_path / "hs", tmp_path / "e.json")
    convert(ConvertParams(draft_vocab_size=64), "bfloat16", verifier_dir, prepared, tmp_path / "hs",
            tmp_path / "vocab", tmp_path / "d.json")
    train_draft(TrainParams(steps=10, eval_every=10, total_seq_len=256, lr=3e-3, warmup_steps=1),
                TrainInputs(verifier=verifier_dir, prepared=prepared, hidden_states=tmp_path / "hs",
                            vocab=tmp_path / "vocab", out=tmp_path / "draft", metrics=tmp_path / "t.json",
                            live_dir=tmp_path / "live", checkpoints=tmp_path / "ck"))
    drafter = EagleDrafter(load_draft(tmp_path / "draft", tiny_verifier_dir), 300)
    for prompt in (PROMPT, PROMPT[:3] * 3, list(range(20, 60))):
        reference, _ = plain_decode(verifier, prompt, 24, eos_ids=set())
        result = speculative_decode(verifier, drafter, prompt, K, 24, eos_ids=set())
        assert result.tokens == reference
        assert result.verify_steps >= 1


def test_speculative_sampling_keeps_the_verifier_distribution():
    """One draft position on a 5-token vocabulary: accepted-or-resampled tokens are distributed as p."""
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    q = torch.tensor([0.1, 0.1, 0.4, 0.2, 0.2])
    logits = torch.log(torch.stack([p, p]))  # position 0 verifies the draft; position 1 is the bonus
    counts = torch.zeros(5)
    trials = 20000
    for _ in range(trials):
        draft = int(torch.multinomial(q, 1, generator=generator))
        accepted, bonus = _verify([draft], [q], logits, 1.0, generator)
        counts[draft if accepted else bonus] += 1
    assert torch.allclose(counts / trials, p, atol=0.015), counts / trials


def test_ngram_baseline_replays_prompt_lookup():
    # The output repeats the prompt's tail, so lookup proposes it.
    steps, accepted, per_position = ngram_acceptance([1, 2, 3, 4, 1, 2], [3, 4, 1, 2, 9], k=3)
    assert (steps, accepted) == (2, 3) and per_position == [1, 1, 1]
    assert ngram_acceptance([1, 2], [7, 8, 9], k=2) == (3, 0, [0, 0])


def test_incremental_drafting_matches_the_training_forward(verifier: VerifierRunner, tiny_verifier_dir: Path):
    """The drafter's first proposal at every prefix equals speculators' own (training) forward, TTT step 0."""
    from speculators.models.eagle3 import Eagle3DraftModel

    from eaglenest.params import TrainParams
    from eaglenest.verifier import VerifierInfo

    info = VerifierInfo(source="x", kind="local", path=str(tiny_verifier_dir), name="x", fingerprint="x",
                        model_type="llama", num_layers=8, hidden_size=32, vocab_size=300,
                        max_position_embeddings=512, aux_layers=[1, 3, 5], layer_ids=[1, 3, 5, 8],
                        trust_remote_code=False)
    from eaglenest.train import build_draft

    torch.manual_seed(3)
    draft: Eagle3DraftModel = build_draft(info, tiny_verifier_dir, TrainParams(), 300, None, None, "sdpa")
    for parameter in draft.parameters():  # a random but non-trivial draft
        if parameter.requires_grad:
            parameter.data.normal_(0, 0.5)
    draft.eval()
    reference, _ = plain_decode(verifier, PROMPT, 12, eos_ids=set())
    row = PROMPT + reference
    verifier.reset()
    _, aux = verifier.extend(row)  # [L, 3, H]
    L = len(row)
    with torch.no_grad():
        expected = draft(hidden_states=aux[:-1].flatten(1)[None], input_ids=torch.tensor([row[1:]]),
                         document_ids=torch.zeros(1, L - 1, dtype=torch.long),
                         position_ids=torch.arange(1, L)[None], ttt_steps=1)[0][0].tolist()
    drafter = EagleDrafter(draft, 300)
    for m in range(2, L - 1):
        drafter.start(row[:m], aux[:m], row[m])
        proposal, _ = drafter.propose(1, 0.0, None)
        assert proposal == [expected[m - 1]], m
