"""Speculative decoding, checked against transformers' own ``generate`` (which shares no code with it).

Exact tau for scripted drafts that accept a known number of tokens, a trained draft that is lossless,
the drafter's state after a partial acceptance, speculative sampling that keeps the verifier's
distribution, and the n-gram baseline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from eaglenest.core.chat import cut_after_end_of_turn
from eaglenest.stages.evaluate.acceptance import Acceptance
from eaglenest.stages.evaluate.ngram import ngram_acceptance
from eaglenest.stages.evaluate.speculative import EagleDrafter, VerifierRunner, _verify, speculative_decode

K = 3
PROMPT = [5, 17, 42, 8, 99, 23, 7]
VOCAB = 300  # the tiny verifier's
AUX_LAYERS = [1, 3, 5]


def generate_greedy(model: Any, prompt: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """The verifier's greedy continuation from transformers' ``generate``, cut after the first end of turn.

    Args:
        model: The verifier (a transformers causal LM).
        prompt: Prompt token ids.
        max_new_tokens: Tokens to generate at most.
        eos_ids: End-of-turn ids; empty means "never stop early".

    Returns:
        The generated tokens, up to and including the first end-of-turn token.
    """
    with torch.inference_mode():
        output = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_k=None,
            top_p=None,
            # None overrides the model's own end of turn, so "no eos" really runs to max_new_tokens.
            eos_token_id=sorted(eos_ids) or None,
            pad_token_id=0,
        )
    tokens = output[0, len(prompt) :].tolist()
    if not eos_ids:
        assert len(tokens) == max_new_tokens  # a silent early stop would shorten every reference
    return cut_after_end_of_turn(tokens, eos_ids)


class ScriptedDrafter:
    """Proposes the first ``correct`` tokens of the verifier's true continuation, then wrong tokens.

    ``correct = K`` is the oracle, ``correct = 0`` the always-wrong draft.
    """

    def __init__(self, reference: list[int], correct: int) -> None:
        self.reference, self.correct = reference, correct

    def start(self, prompt, aux, next_token):
        assert aux.shape[0] == len(prompt)
        self.position = 0  # index of next_token in the reference output
        assert next_token == self.reference[0]

    def propose(self, k, temperature, generator):
        truth = self.reference[self.position + 1 : self.position + 1 + k]
        # The decoder always drafts K, also near max_new_tokens: the reference must reach that far.
        assert len(truth) == k, "reference continuation too short"
        return truth[: self.correct] + [(t + 1) % VOCAB for t in truth[self.correct :]], None

    def accept(self, tokens, aux, next_token):
        assert aux.shape[0] == len(tokens)
        self.position += len(tokens)
        assert next_token == self.reference[self.position]


@pytest.fixture(scope="module")
def verifier(tiny_verifier_dir: Path) -> VerifierRunner:
    model = AutoModelForCausalLM.from_pretrained(tiny_verifier_dir, dtype=torch.float32).eval()
    return VerifierRunner(model, AUX_LAYERS)


@pytest.mark.parametrize("correct", range(K + 1))
def test_scripted_draft_gives_exact_tau(verifier: VerifierRunner, correct: int):
    """A draft whose first ``correct`` tokens are right gets exactly those accepted: tau = 1 + correct."""
    max_new = 1 + 12  # 12 tokens after the first divide evenly into rounds of 1..K+1 tokens
    reference = generate_greedy(verifier.model, PROMPT, max_new + K + 1, eos_ids=set())
    result = speculative_decode(verifier, ScriptedDrafter(reference, correct), PROMPT, K, max_new, eos_ids=set())
    assert result.tokens == reference[:max_new]
    assert result.acceptance.tau == 1 + correct
    assert result.acceptance.steps == 12 // (correct + 1)
    assert result.acceptance.drafted == K * result.acceptance.steps
    metrics = result.acceptance.summary()
    assert metrics["per_position_acceptance"] == [1.0] * correct + [0.0] * (K - correct)
    assert metrics["draft_acceptance_rate"] == round(correct / K, 4)
    assert metrics["verify_steps"] == result.acceptance.steps


def test_oracle_draft_accepts_every_draft(verifier: VerifierRunner):
    """A decoder that never accepts a correct draft (or accepts one too many) fails here."""
    max_new = 1 + 5 * (K + 1)
    reference = generate_greedy(verifier.model, PROMPT, max_new + K + 1, eos_ids=set())
    result = speculative_decode(verifier, ScriptedDrafter(reference, K), PROMPT, K, max_new, eos_ids=set())
    assert result.tokens == reference[:max_new]
    assert result.acceptance == Acceptance(K, steps=5, drafted=5 * K, accepted=5 * K, per_position=[5] * K)
    assert result.acceptance.tau == K + 1


def test_decoding_stops_when_an_accepted_draft_ends_the_turn(verifier: VerifierRunner):
    reference = generate_greedy(verifier.model, PROMPT, 12 + K + 1, eos_ids=set())
    assert reference.index(reference[2]) == 2  # the end of turn below first appears there
    eos = {reference[2]}  # the oracle's first round proposes reference[1..3]: the end of turn is accepted
    plain = generate_greedy(verifier.model, PROMPT, 12, eos_ids=eos)
    result = speculative_decode(verifier, ScriptedDrafter(reference, K), PROMPT, K, 12, eos_ids=eos)
    assert result.tokens == plain == reference[:3]
    assert result.acceptance.steps == 1  # no round is spent generating past the end of the reply


def test_always_wrong_draft_gives_tau_one(verifier: VerifierRunner):
    reference = generate_greedy(verifier.model, PROMPT, 12 + K + 1, eos_ids=set())
    result = speculative_decode(verifier, ScriptedDrafter(reference, 0), PROMPT, K, 12, eos_ids=set())
    assert result.tokens == reference[:12]  # still lossless: every token is the verifier's own
    metrics = result.acceptance.summary()
    assert metrics["tau"] == 1.0 and metrics["draft_acceptance_rate"] == 0.0
    assert result.acceptance.steps == 11


def test_trained_draft_is_lossless_at_temperature_zero(
    verifier: VerifierRunner, tmp_path: Path, tiny_verifier_dir: Path
):
    from eaglenest.artifacts.draft import load_draft
    from eaglenest.artifacts.hidden_states.extract_params import ExtractParams
    from eaglenest.stages.convert import convert
    from eaglenest.stages.convert.params import ConvertParams
    from eaglenest.stages.extract import extract_hidden_states
    from eaglenest.stages.train import TrainPaths, train_draft
    from eaglenest.stages.train.params import TrainParams
    from tests.fixtures.pipeline import pipeline_until_prepare

    verifier_dir, prepared = pipeline_until_prepare(tmp_path, tiny_verifier_dir, rows=20)
    extract_hidden_states(ExtractParams(), verifier_dir, prepared, tmp_path / "hs", tmp_path / "e.json")
    convert(
        ConvertParams(draft_vocab_size=64),
        ExtractParams(dtype="bfloat16"),
        verifier_dir,
        prepared,
        tmp_path / "hs",
        tmp_path / "vocab",
        tmp_path / "d.json",
    )
    train_draft(
        TrainParams(steps=10, eval_every=10, total_seq_len=256, lr=3e-3, warmup_steps=1),
        TrainPaths(
            verifier=verifier_dir,
            prepared=prepared,
            hidden_states=tmp_path / "hs",
            vocab=tmp_path / "vocab",
            out=tmp_path / "draft",
            metrics=tmp_path / "t.json",
            details=tmp_path / "t_details.json",
            live_dir=tmp_path / "live",
            checkpoints=tmp_path / "ck",
        ),
    )
    drafter = EagleDrafter(load_draft(tmp_path / "draft", tiny_verifier_dir), VOCAB)
    # Ten steps on a random verifier's data get no draft accepted (measured: 0 of 207), so this test checks
    # only losslessness; test_oracle_draft_accepts_every_draft fails if correct drafts are not accepted.
    for prompt in (PROMPT, PROMPT[:3] * 3, list(range(20, 60))):
        reference = generate_greedy(verifier.model, prompt, 24, eos_ids=set())
        result = speculative_decode(verifier, drafter, prompt, K, 24, eos_ids=set())
        assert result.tokens == reference
        assert result.acceptance.steps >= 1 and result.acceptance.drafted == K * result.acceptance.steps


@pytest.fixture(scope="module", params=[False, True], ids=["eagle3", "eagle3.1-norms"])
def random_draft(request: pytest.FixtureRequest, tiny_verifier_dir: Path) -> Any:
    """A random but non-trivial EAGLE-3 draft for the tiny verifier (full vocabulary, no d2t); also with
    EAGLE-3.1's two norms (``train.norm_before_fc``, ``train.norm_output``), which change what is fed back."""
    from eaglenest.artifacts.verifier import VerifierInfo
    from eaglenest.stages.train.model import build_draft
    from eaglenest.stages.train.params import TrainParams

    info = VerifierInfo(
        source="x",
        kind="local",
        path=str(tiny_verifier_dir),
        name="x",
        fingerprint="x",
        model_type="llama",
        num_layers=8,
        hidden_size=32,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        aux_layers=AUX_LAYERS,
        layer_ids=[*AUX_LAYERS, 8],
        trust_remote_code=False,
    )
    torch.manual_seed(3)
    params = TrainParams(norm_before_fc=request.param, norm_output=request.param)
    draft = build_draft(info, tiny_verifier_dir, params, VOCAB, None, None, "sdpa")
    assert (draft.input_norm is not None) == draft.config.norm_output == request.param
    for parameter in draft.parameters():
        if parameter.requires_grad:
            parameter.data.normal_(0, 0.5)
    return draft.eval()


def _training_forward_predictions(draft: Any, verifier: VerifierRunner, row: list[int]) -> tuple[list[int], Any]:
    """speculators' own (training) forward over ``row``, TTT step 0, and the verifier's aux states over ``row``.

    Returns:
        (``predictions``, ``aux``): ``predictions[n - 1]`` is the draft's first proposal once ``row[:n]`` is
        verified and ``row[n]`` is the verifier's next token; ``aux`` is ``[len(row), n_aux, H]``.
    """
    verifier.reset()
    _, aux = verifier.extend(row)  # [L, 3, H]
    length = len(row)
    with torch.no_grad():
        predictions = draft(
            hidden_states=aux[:-1].flatten(1)[None],
            input_ids=torch.tensor([row[1:]]),
            document_ids=torch.zeros(1, length - 1, dtype=torch.long),
            position_ids=torch.arange(1, length)[None],
            ttt_steps=1,
        )[0][0].tolist()
    return predictions, aux


def test_incremental_drafting_matches_the_training_forward(verifier: VerifierRunner, random_draft: Any):
    """The drafter's first proposal at every prefix equals speculators' own (training) forward, TTT step 0."""
    row = PROMPT + generate_greedy(verifier.model, PROMPT, 12, eos_ids=set())
    expected, aux = _training_forward_predictions(random_draft, verifier, row)
    drafter = EagleDrafter(random_draft, VOCAB)
    for m in range(2, len(row) - 1):
        drafter.start(row[:m], aux[:m], row[m])
        proposal, _ = drafter.propose(1, 0.0, None)
        assert proposal == [expected[m - 1]], m


def test_every_draft_step_matches_the_training_forward(verifier: VerifierRunner, random_draft: Any):
    """All K proposals, not only the first, equal speculators' training forward over TTT steps 0..K-1.

    Training teacher-forces the true next tokens into later TTT steps, so the row continues with the
    drafter's own proposals: then TTT step s at the last verified column sees exactly what draft step s saw
    (causal attention keeps the columns after it out).
    """
    row = PROMPT + generate_greedy(verifier.model, PROMPT, 12, eos_ids=set())
    drafter = EagleDrafter(random_draft, VOCAB)
    verifier.reset()
    _, aux = verifier.extend(row)
    for m in range(2, len(row)):
        drafter.start(row[:m], aux[:m], row[m])
        proposal, _ = drafter.propose(K, 0.0, None)
        forced = row[: m + 1] + proposal[:-1]  # verified prefix, next token, drafts fed back
        verifier.reset()
        _, forced_aux = verifier.extend(forced)
        with torch.no_grad():
            steps = random_draft(
                hidden_states=forced_aux[:-1].flatten(1)[None],
                input_ids=torch.tensor([forced[1:]]),
                document_ids=torch.zeros(1, len(forced) - 1, dtype=torch.long),
                position_ids=torch.arange(1, len(forced))[None],
                ttt_steps=K,
            )
        assert proposal == [int(step[0, m - 1]) for step in steps], m


@pytest.mark.parametrize("acceptances", [[0], [1], [2], [K], [2, 0, 1]])
def test_drafter_state_after_partial_acceptance_equals_a_fresh_start(
    verifier: VerifierRunner, random_draft: Any, acceptances: list[int]
):
    """Rounds run as speculative_decode runs them leave the drafter as a fresh start on the longer prefix.

    Each round drafts K, has the verifier extend over [next_token, *drafts], accepts the first ``j`` (the
    true continuation, then wrong tokens), cuts the verifier back and tells the drafter. Its next proposals
    must equal a fresh drafter's on the whole verified prefix, and the first of them speculators' training
    forward at that position.
    """
    continuation = generate_greedy(verifier.model, PROMPT, 4 * (K + 1), eos_ids=set())
    row = PROMPT + continuation
    expected, full_aux = _training_forward_predictions(random_draft, verifier, row)
    drafter = EagleDrafter(random_draft, VOCAB)
    fresh = EagleDrafter(random_draft, VOCAB)

    verifier.reset()
    _, aux = verifier.extend(PROMPT)
    drafter.start(PROMPT, aux, continuation[0])
    verified = len(PROMPT)  # tokens in the verifier's cache; row[verified] is the next token
    for j in acceptances:
        drafter.propose(K, 0.0, None)  # its proposals are replaced below; this leaves speculative entries
        next_token = row[verified]
        truth = row[verified + 1 : verified + 1 + K]
        drafts = truth[:j] + [(t + 1) % VOCAB for t in truth[j:]]
        _, aux = verifier.extend([next_token, *drafts])
        verifier.truncate(verifier.length - (K - j))
        assert verifier.length == verified + j + 1
        verified += j + 1
        drafter.accept([next_token, *drafts[:j]], aux[: j + 1], row[verified])

        # The aux states of the cut-back cache are those of one pass over the prefix.
        assert torch.allclose(aux[: j + 1], full_aux[verified - j - 1 : verified], atol=1e-4, rtol=1e-4)
        proposal, _ = drafter.propose(K, 0.0, None)
        fresh.start(row[:verified], full_aux[:verified], row[verified])
        fresh_proposal, _ = fresh.propose(K, 0.0, None)
        assert proposal == fresh_proposal, (acceptances, j)
        assert proposal[0] == expected[verified - 1], (acceptances, j)


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
    # The output repeats the prompt's tail, so lookup proposes it: [3, 4, 1] all accepted, then [3, 4, 1]
    # again against 9, none accepted.
    counts = ngram_acceptance([1, 2, 3, 4, 1, 2], [3, 4, 1, 2, 9], k=3)
    assert (counts.steps, counts.accepted, counts.drafted) == (2, 3, 6)
    assert counts.per_position == [1, 1, 1]
    # No earlier occurrence ever: every step drafts nothing, and is still a verify step.
    assert ngram_acceptance([1, 2], [7, 8, 9], k=2) == Acceptance(
        2, steps=3, drafted=0, accepted=0, per_position=[0, 0]
    )
    # A step without a match is not charged for drafts it never made: 0 + 2 drafted, not 2 * 2.
    counts = ngram_acceptance([1, 2, 5], [1, 2, 5, 6], k=2)
    assert (counts.steps, counts.drafted, counts.accepted) == (2, 2, 2)
    assert counts.summary()["draft_acceptance_rate"] == 1.0 and counts.tau == 2.0
