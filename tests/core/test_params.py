"""Strict params: every bad value is named with what is allowed, all problems at once."""

from __future__ import annotations

from pathlib import Path
from typing import get_args, get_origin

import pytest
import yaml

from eaglenest.artifacts.eval_params import EvalSetsAndEngines, EvaluateParams
from eaglenest.artifacts.hidden_states.extract_params import ExtractParams
from eaglenest.commands.params_file import MOVED_KEYS, Params, load_params, parse_params
from eaglenest.core.errors import ParamsError
from eaglenest.core.params import VllmEngineParams, parse_sections
from eaglenest.stages.k_sweep.params import KSweepStageParams
from eaglenest.stages.prepare.params import PrepareParams
from eaglenest.stages.verifier import check_aux_layers, default_aux_layers
from tests.fixtures.pipeline import REPO


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
    allowed = "verifier, prepare, extract, convert, train, free_sweep, evaluate, k_sweep, cluster"
    assert any(f"verifer: unknown key (allowed: {allowed})" in line for line in lines)
    assert any(line.strip().startswith("- prepare.maxlen: unknown key (allowed: source,") for line in lines)


def test_every_bad_value_is_reported_at_once_with_key_and_value():
    lines = problems(
        {
            "verifier": {"trust_remote_code": "yes", "aux_layers": [3, 3]},
            "prepare": {"max_len": 4, "val_fraction": 1.5, "max_conversations": 0, "seed": "x"},
        }
    )
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
    text = "\n".join(problems({"extract": {"import_path": "x", "batch_tokens": "x"}}))
    assert "extract.batch_tokens = 'x': Input should be a valid integer" in text
    assert "extract.import_path = 'x' is only read by extract.backend: import" in text


def test_cluster_params_name_what_is_allowed():
    """Where the work runs: every bad value in one report; the removed static parts say what replaced them."""
    lines = problems(
        {
            "cluster": {"executor": "slurm", "address": "head-node", "workers": 0, "max_task_retries": 0},
            "extract": {"rank": 1, "world_size": 2},
        }
    )
    assert lines[0] == "params.yaml: 6 invalid params values"
    assert "  - cluster.executor = 'slurm': Input should be 'local' or 'ray'" in lines
    assert (
        "  - cluster.address = 'head-node': allowed: 'local', 'auto' or host:port (the head's GCS port, 6379 by "
        "default)"
    ) in lines
    assert "  - cluster.workers = 0: must be >= 1, or 'auto'" in lines
    assert "  - cluster.max_task_retries = 0: Input should be greater than or equal to 1" in lines
    for key in ("rank", "world_size"):
        assert (
            f"  - extract.{key}: removed; use cluster.executor: ray, which shares the shards over the nodes of a "
            "Ray cluster (docs/scale-out.md)"
        ) in lines
    cluster = parse_params({"cluster": {"executor": "ray", "address": "10.0.0.1:6379", "workers": 16}}).cluster
    assert (cluster.address, cluster.workers, cluster.output) == ("10.0.0.1:6379", 16, "driver")


@pytest.mark.parametrize("value", ["bad host:6379", "[::1]:6379", "head:0", "head:65536", "head:", ":6379"])
def test_every_host_and_port_is_read_alike(value: str):
    """A Ray head's address and a rendezvous endpoint take the same HOST:PORT, each in its key's own words."""
    lines = problems({"cluster": {"address": value, "torchrun": {"rdzv_endpoint": value}}})
    assert (
        f"  - cluster.address = {value!r}: allowed: 'local', 'auto' or host:port (the head's GCS port, 6379 by "
        "default)" in lines
    )
    assert (
        f"  - cluster.torchrun.rdzv_endpoint = {value!r}: must be HOST:PORT: a host name or IPv4 address, and a "
        "port in 1..65535"
    ) in lines
    for good in ("10.0.0.1:6379", "node-a.cluster_1:29500"):
        cluster = parse_params({"cluster": {"address": good, "torchrun": {"rdzv_endpoint": good}}}).cluster
        assert (cluster.address, cluster.torchrun.rdzv_endpoint) == (good, good)


def test_tensor_parallelism_needs_a_vllm_back_end_in_every_stage():
    """A verifier spread over GPUs needs vLLM wherever it runs; the hf back ends load it on one device. The
    three refusals come in one report, each naming its section's engine key."""
    lines = problems(
        {
            "prepare": {"regenerate_backend": "hf", "regenerate_vllm": {"tensor_parallel_size": 8}},
            "extract": {"backend": "hf", "vllm": {"tensor_parallel_size": 8}},
            "evaluate": {"backend": ["hf"], "vllm": {"tensor_parallel_size": 8}},
        }
    )
    assert lines[0] == "params.yaml: 3 invalid params values"
    assert lines[1:] == [
        "  - prepare.regenerate_vllm.tensor_parallel_size = 8 needs prepare.regenerate_backend: vllm (the hf back "
        "end runs on one device); set it to 1 or switch the back end",
        "  - extract.vllm.tensor_parallel_size = 8 needs extract.backend: vllm (the hf back end runs on one "
        "device); set it to 1 or switch the back end",
        "  - evaluate.vllm.tensor_parallel_size = 8 is only used by the vllm back end, and evaluate.backend is "
        "['hf']; set it to 1 or add vllm to evaluate.backend",
    ]
    params = parse_params(
        {
            "prepare": {"regenerate_vllm": {"tensor_parallel_size": 8}},
            "evaluate": {"backend": ["hf", "vllm"], "vllm": {"tensor_parallel_size": 8}},
        }
    )
    assert params.prepare.regenerate_vllm.tensor_parallel_size == 8 and params.evaluate.vllm.tensor_parallel_size == 8


def test_a_width_refusal_comes_with_an_unrelated_bad_value_and_a_missing_engine_section():
    text = "\n".join(
        problems(
            {
                "extract": {"backend": "hf", "vllm": {"tensor_parallel_size": 2}, "batch_tokens": "x"},
                "evaluate": {"backend": "hf", "timed_prompts": -1},
            }
        )
    )
    assert "extract.batch_tokens = 'x': Input should be a valid integer" in text
    assert "extract.vllm.tensor_parallel_size = 2 needs extract.backend: vllm" in text
    assert "evaluate.timed_prompts = -1: Input should be greater than or equal to 0" in text  # no vllm: given
    assert "evaluate.vllm" not in text


def test_a_moved_key_says_where_it_went_next_to_other_problems():
    lines = problems(
        {
            "prepare": {"regenerate_tensor_parallel_size": 8, "max_len": 4},
            "extract": {"vllm_dtype": "float32", "gpu_memory_utilization": 0.5, "tensor_parallel_size": 2},
            "evaluate": {"vllm_dtype": "bfloat16", "gpu_memory_utilization": 0.9, "tensor_parallel_size": 2},
        }
    )
    assert lines[0] == "params.yaml: 8 invalid params values"
    assert "  - prepare.regenerate_tensor_parallel_size moved to prepare.regenerate_vllm.tensor_parallel_size" in lines
    assert "  - prepare.max_len = 4: Input should be greater than or equal to 16" in lines
    for section in ("extract", "evaluate"):
        assert f"  - {section}.vllm_dtype moved to {section}.vllm.dtype" in lines
        assert f"  - {section}.gpu_memory_utilization moved to {section}.vllm.gpu_memory_utilization" in lines
        assert f"  - {section}.tensor_parallel_size moved to {section}.vllm.tensor_parallel_size" in lines
    assert not any("unknown key" in line for line in lines)


def test_every_moved_key_names_a_key_that_exists():
    for old, new in MOVED_KEYS.items():
        target = new.split(" ")[0]  # "evaluate.sets (each set's num_prompts)": the key, then a hint
        section, *path = target.split(".")
        model = Params.model_fields[section].annotation
        for part in path:
            assert part in model.model_fields, new
            annotation = model.model_fields[part].annotation
            model = get_args(annotation)[0] if get_origin(annotation) is list else annotation
        assert old.split(".")[1] not in Params.model_fields[section].annotation.model_fields, old
    assert len(MOVED_KEYS) == 14


def test_the_three_vllm_back_ends_share_one_engine_model():
    engine = PrepareParams.model_fields["regenerate_vllm"].annotation
    assert engine is ExtractParams.model_fields["vllm"].annotation is EvaluateParams.model_fields["vllm"].annotation
    assert engine is VllmEngineParams
    assert Params().extract.vllm == VllmEngineParams(dtype="auto", gpu_memory_utilization=0.85, tensor_parallel_size=1)


def test_a_nested_override_parses_like_dvc_exp_run_s(tmp_path: Path):
    """`dvc exp run -S extract.vllm.dtype=float32` writes the nested key into params.yaml; the rest of the
    engine keeps its values."""
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["extract"]["vllm"]["dtype"] = "float32"
    raw["prepare"]["regenerate_vllm"]["tensor_parallel_size"] = 2
    edited = tmp_path / "params.yaml"
    edited.write_text(yaml.safe_dump(raw, sort_keys=False))
    params = load_params(edited)
    assert params.extract.vllm == VllmEngineParams(dtype="float32")
    assert params.prepare.regenerate_vllm.tensor_parallel_size == 2 and params.evaluate.vllm == VllmEngineParams()
    text = "\n".join(problems({"extract": {"vllm": {"dtype": "float64", "gpu_memory_utilization": 1.5}}}))
    assert "extract.vllm.dtype = 'float64': Input should be 'auto', 'float32', 'bfloat16' or 'float16'" in text
    assert "extract.vllm.gpu_memory_utilization = 1.5: Input should be less than or equal to 1" in text


def test_the_k_sweep_reads_evaluates_sets_and_engines_and_nothing_else_of_it():
    """Its params deps in dvc.yaml are these keys (tests/project), so an experiment on evaluate's timed turns leaves
    the sweep's record standing; the keys it shares are evaluate's own fields, declared once."""
    shared = set(EvalSetsAndEngines.model_fields)
    assert shared < set(EvaluateParams.model_fields) and issubclass(EvaluateParams, EvalSetsAndEngines)
    assert {"timed_prompts", "timing", "reference_prompts", "num_speculative_tokens", "bf16_tie_margin"}.isdisjoint(
        shared
    )
    raw = {"evaluate": {"timed_prompts": 2, "seed": 3, "vllm": {"dtype": "float32"}}}
    read = parse_sections(raw, KSweepStageParams, "params.yaml").evaluate
    assert (read.seed, read.vllm.dtype) == (3, "float32") and not hasattr(read, "timed_prompts")
    assert "evaluate.seed" in "\n".join(problems({"evaluate": {"seed": "three"}}))
