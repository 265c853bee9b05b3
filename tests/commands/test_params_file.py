"""The whole params file assembled from the stages' sections, and a stage's own check of the sections it reads."""

from __future__ import annotations

import pytest

from eaglenest.artifacts.hidden_states.extract_params import ExtractParams
from eaglenest.commands.params_file import SECTIONS, STAGE_PARAMS, Params, parse_params
from eaglenest.core.errors import ParamsError
from eaglenest.core.params import HiddenStateStorage, StrictModel, TorchrunParams, parse_sections
from eaglenest.core.registry import Registry
from eaglenest.stages.convert.params import ConvertStageParams
from eaglenest.stages.train.params import TrainParams, TrainStageParams


def problems(raw, model) -> list[str]:
    with pytest.raises(ParamsError) as info:
        parse_sections(raw, model)
    return str(info.value).splitlines()


def test_the_file_is_every_stages_own_section_then_cluster_in_pipeline_order():
    assert list(Params.model_fields) == [
        "verifier",
        "prepare",
        "extract",
        "convert",
        "train",
        "free_sweep",
        "evaluate",
        "k_sweep",
        "cluster",
    ]
    # every stage reads its own section but plan, which has none (it reads evaluate's)
    assert [name for name, _ in STAGE_PARAMS.items()] == [*list(Params.model_fields)[:-1], "plan"]
    for name, model in STAGE_PARAMS.items():
        if name != "plan":
            assert model.model_fields[name].annotation is SECTIONS.get(name).model


def test_a_stage_reads_of_another_section_only_keys_that_section_declares_alike():
    """A view (convert's of extract's storage settings) is a true part of the section: same keys, types, defaults."""
    for stage, model in STAGE_PARAMS.items():
        for section, field in model.model_fields.items():
            whole = SECTIONS.get(section).model
            if field.annotation is whole:
                continue
            for key, view_field in field.annotation.model_fields.items():
                own = whole.model_fields.get(key)
                assert own is not None, f"{stage} reads {section}.{key}, which {section} does not declare"
                assert (own.annotation, own.default, own.description) == (
                    view_field.annotation,
                    view_field.default,
                    view_field.description,
                ), f"{section}.{key}"


def test_a_section_registered_twice_is_refused():
    sections: Registry[type[StrictModel]] = Registry("params section")
    sections.register("train", StrictModel)
    with pytest.raises(ValueError, match="params section 'train' is already registered"):
        sections.register("train", StrictModel)
    assert [name for name, _ in sections.items()] == ["train"]


def test_a_stage_refuses_typos_in_its_own_sections_and_ignores_the_others():
    raw = {"train": {"stepz": 3}, "cluster": {"torchrun": {"max_restart": 1}}, "prepare": {"bogus": 1}, "trian": {}}
    train, torchrun = TrainParams.model_fields, TorchrunParams.model_fields
    assert problems(raw, TrainStageParams)[1:] == [
        f"  - train.stepz: unknown key (allowed: {', '.join(train)})",
        f"  - cluster.torchrun.max_restart: unknown key (allowed: {', '.join(torchrun)})",
    ]
    whole = problems(raw, Params)
    assert "  - prepare.bogus: unknown key" in [line.partition(" (")[0] for line in whole]
    assert "  - trian: unknown key" in [line.partition(" (")[0] for line in whole]
    assert parse_sections({"prepare": {"bogus": 1}, "trian": {}}, TrainStageParams) == TrainStageParams()


def test_a_check_across_sections_runs_in_the_stage_that_reads_both_and_in_the_whole_file():
    raw = {"train": {"nproc": 3, "steps": 0}, "cluster": {"torchrun": {"min_nodes": 2}}}
    world = (
        "  - cluster.torchrun.nproc_per_node: null means train.nproc / cluster.torchrun.max_nodes = 3 / 2, not a "
        "whole number; set cluster.torchrun.nproc_per_node"
    )
    for model in (TrainStageParams, Params):
        lines = problems(raw, model)
        assert lines[0] == "params.yaml: 2 invalid params values"  # with the unrelated bad value, all at once
        assert world in lines and "  - train.steps = 0: Input should be greater than or equal to 1" in lines


def test_convert_reads_extracts_storage_settings_and_leaves_the_rest_of_extract_to_its_stage():
    raw = {"extract": {"dtype": "float32", "store": "online", "backend": "vllm", "bogus": 1}}
    params = parse_sections(raw, ConvertStageParams)
    assert params.extract == HiddenStateStorage(dtype="float32", store="online")
    assert problems({"extract": {"dtype": "float16"}}, ConvertStageParams)[1].startswith(
        "  - extract.dtype = 'float16': Input should be 'bfloat16', 'float32' or 'float8_e4m3fn'"
    )
    # extract's own check refuses what convert need not know (its keys, its combinations)
    assert len(problems(raw, Params)) == 3
    assert ExtractParams(dtype="float32").dtype == "float32"


def test_the_whole_file_answers_moved_keys_with_where_they_went():
    lines = problems({"prepare": {"regenerate_vllm_dtype": "auto"}, "extract": {"rank": 0}}, Params)
    assert lines[1:] == [
        "  - prepare.regenerate_vllm_dtype moved to prepare.regenerate_vllm.dtype",
        "  - extract.rank: removed; use cluster.executor: ray, which shares the shards over the nodes of a Ray "
        "cluster (docs/scale-out.md)",
    ]
    assert parse_params({}) == Params()
