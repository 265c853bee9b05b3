"""Reading one hidden-state file: a bad file raises one error naming it and what is wrong, never a value to test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eaglenest.artifacts.hidden_states.format import (
    ROW_INDEX_KEY,
    TOKENS_KEY,
    HiddenStateFileError,
    checked_hidden_states,
    encode_hidden_states,
    file_metadata,
    hs_path,
    read_hidden_state_file,
    read_shard_tensor,
)
from eaglenest.artifacts.hidden_states.layout import write_hidden_states
from eaglenest.artifacts.verifier import VerifierInfo

TOKENS = [5, 6, 7]
VERIFIER = VerifierInfo(
    source="tiny",
    kind="local",
    path=".",
    name="tiny",
    fingerprint="f",
    model_type="llama",
    num_layers=2,
    hidden_size=4,
    vocab_size=16,
    max_position_embeddings=32,
    aux_layers=[1],
    layer_ids=[1, 2],
    trust_remote_code=False,
)


@pytest.fixture
def row_file(tmp_path: Path) -> Path:
    path = hs_path(tmp_path, 0)
    hidden = torch.arange(len(TOKENS) * 2 * 4, dtype=torch.float32).reshape(len(TOKENS), 2, 4)
    write_hidden_states(
        path,
        encode_hidden_states(hidden, "float32"),
        torch.tensor(TOKENS),
        file_metadata("config", VERIFIER.layer_ids, "float32", "hf"),
    )
    return path


def test_a_good_row_file_reads_as_its_tensors(row_file: Path):
    assert read_hidden_state_file(row_file, TOKENS, VERIFIER, "float32")[TOKENS_KEY].tolist() == TOKENS
    assert read_shard_tensor(row_file, TOKENS_KEY).tolist() == TOKENS


def test_reading_a_truncated_file_raises_naming_it(row_file: Path):
    row_file.write_bytes(row_file.read_bytes()[:-5])
    with pytest.raises(HiddenStateFileError, match="truncated") as raised:
        read_hidden_state_file(row_file, TOKENS, VERIFIER, "float32")
    assert raised.value.path == row_file and str(raised.value).startswith(f"{row_file}: ")
    row_file.write_bytes(b"not a safetensors file")
    with pytest.raises(HiddenStateFileError, match="unreadable") as raised:
        read_shard_tensor(row_file, TOKENS_KEY)
    assert raised.value.path == row_file


def test_reading_a_file_of_other_tokens_raises_naming_the_position(row_file: Path):
    with pytest.raises(HiddenStateFileError, match=r"token_ids differ .*position 1") as raised:
        read_hidden_state_file(row_file, [5, 9, 7], VERIFIER, "float32")
    assert raised.value.problem.startswith("token_ids differ")


def test_a_missing_tensor_raises_naming_the_file(row_file: Path):
    with pytest.raises(HiddenStateFileError, match="unreadable") as raised:
        read_shard_tensor(row_file, ROW_INDEX_KEY)  # a row file has no row index
    assert raised.value.path == row_file


def test_a_row_holding_a_non_finite_value_raises_naming_its_file_token_and_slot(tmp_path: Path):
    hidden = torch.zeros(len(TOKENS), 2, 4)
    hidden[1, 1, 0] = float("nan")
    path = tmp_path / "shard_0.safetensors"
    with pytest.raises(HiddenStateFileError, match="1 non-finite values \\(first at token 1, slot 1\\)") as raised:
        checked_hidden_states(
            path, {TOKENS_KEY: torch.tensor(TOKENS), **encode_hidden_states(hidden, "float32")}, TOKENS
        )
    assert raised.value.path == path
