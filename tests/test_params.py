"""Strict params: every bad value is named with what is allowed, all problems at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from eaglenest.core.errors import ParamsError
from eaglenest.core.params import Params, load_params, parse_params
from eaglenest.stages.verifier import check_aux_layers, default_aux_layers

from .helpers import REPO


def problems(raw) -> list[str]:
    with pytest.raises(ParamsError) as info:
        parse_params(raw)
    return str(info.value).splitlines()


def test_repo_params_yaml_is_valid_and_matches_defaults():
    assert load_params(REPO / "params.yaml") == Params()


def test_empty_file_means_defaults():
    assert parse_params(None) == Params()


def test_unknown_top_level_and_nested_keys_are_errors_listing_allowed_keys():
    lines = problems({"verifer": {}, "prepare": {"maxlen": 5}})
    assert lines[0] == "params.yaml: 2 invalid params values"
    allowed = "verifier, prepare, extract, convert, train, evaluate"
    assert any(f"verifer: unknown key (allowed: {allowed})" in line for line in lines)
    assert any(line.strip().startswith("- prepare.maxlen: unknown key (allowed: source,") for line in lines)


def test_every_bad_value_is_reported_at_once_with_key_and_value():
    lines = problems({
        "verifier": {"trust_remote_code": "yes", "aux_layers": [3, 3]},
        "prepare": {"max_len": 4, "val_fraction": 1.5, "max_conversations": 0, "seed": "x"},
    })
    text = "\n".join(lines)
    assert lines[0] == "params.yaml: 6 invalid params values"
    assert "verifier.trust_remote_code = 'yes': Input should be a valid boolean" in text
    assert "verifier.aux_layers = [3, 3]: layer ids must be distinct" in text
    assert "prepare.max_len = 4: Input should be greater than or equal to 16" in text
    assert "prepare.val_fraction = 1.5: Input should be less than 1" in text
    assert "prepare.max_conversations = 0: Input should be greater than or equal to 1" in text
    assert "prepare.seed = 'x': Input should be a valid integer" in text


def test_aux_layer_zero_is_refused():
    assert any("layer ids must be >= 1" in line for line in problems({"verifier": {"aux_layers": [0, 4]}}))


def test_single_source_string_becomes_a_list():
    prepare = parse_params({"prepare": {"source": "data/conversations/a.jsonl"}}).prepare
    assert prepare.source_names == ["data/conversations/a.jsonl"] and prepare.source[0].weight == 1.0


def test_yaml_syntax_error_names_the_line(tmp_path: Path):
    bad = tmp_path / "params.yaml"
    bad.write_text("verifier:\n  model: [unclosed\nprepare: {}\n")
    with pytest.raises(ParamsError, match=r"params.yaml: line \d+, column \d+: not valid YAML"):
        load_params(bad)


def test_missing_params_file(tmp_path: Path):
    with pytest.raises(ParamsError, match="params file not found"):
        load_params(tmp_path / "nope.yaml")


def test_default_aux_layers_for_smollm2():
    assert default_aux_layers(30) == [2, 15, 27]


@pytest.mark.parametrize(
    ("aux", "explicit", "message"),
    [
        ([2, 30], True, r"verifier.aux_layers = \[2, 30\]: ids \[30\] fall outside 1..29 for a 30-layer verifier"),
        ([2, 2, 1], False, r"default aux layers \[2, 2, 1\].*collide.*set verifier.aux_layers to distinct ids in 1..3"),
        ([5, -1], True, r"ids \[-1\] fall outside 1..29"),
    ],
)
def test_aux_layers_checked_against_layer_count(aux, explicit, message):
    num_layers = 30 if explicit else 4
    with pytest.raises(ParamsError, match=message):
        check_aux_layers(aux, num_layers, explicit=explicit)


def test_aux_layers_sorted():
    assert check_aux_layers([20, 3, 10], 30, explicit=True) == [3, 10, 20]


def test_a_bad_combination_is_reported_next_to_an_unrelated_bad_value():
    text = "\n".join(problems({"extract": {"rank": 5, "batch_tokens": "x"}}))
    assert "extract.batch_tokens = 'x': Input should be a valid integer" in text
    assert "extract.rank = 5 must be < extract.world_size = 1" in text


def test_tensor_parallelism_needs_a_vllm_back_end_in_every_stage():
    """A verifier spread over GPUs needs vLLM wherever it runs; the hf back ends load it on one device."""
    text = "\n".join(problems({
        "prepare": {"regenerate_backend": "hf", "regenerate_tensor_parallel_size": 4},
        "extract": {"backend": "hf", "tensor_parallel_size": 4},
        "evaluate": {"backend": ["hf"], "tensor_parallel_size": 4},
    }))
    assert "prepare.regenerate_tensor_parallel_size = 4 needs prepare.regenerate_backend: vllm" in text
    assert "extract.tensor_parallel_size = 4 needs extract.backend: vllm" in text
    assert "evaluate.tensor_parallel_size = 4 is only used by the vllm back end" in text
    params = parse_params({"prepare": {"regenerate_tensor_parallel_size": 8},
                           "evaluate": {"backend": ["hf", "vllm"], "tensor_parallel_size": 8}})
    assert params.prepare.regenerate_tensor_parallel_size == 8 and params.evaluate.tensor_parallel_size == 8
