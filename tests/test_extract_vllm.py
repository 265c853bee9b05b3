"""The vllm extract back end without a GPU: the LLM arguments it builds, and the staged-file move."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglenest.errors import EaglenestError
from eaglenest.extract import ExtractionJob, extract_hidden_states
from eaglenest.extract_vllm import build_llm_kwargs, extract_with_vllm, staging_dir_for
from eaglenest.hidden_states import hs_path
from eaglenest.params import ExtractParams
from eaglenest.verifier import load_verifier_info

from .test_extract import pipeline_until_prepare


class FakeEngine:
    """Stands in for vllm.LLM: writes staged files the way ExampleHiddenStatesConnector does."""

    def __init__(self, kwargs: dict, corrupt_tokens: bool = False) -> None:
        self.kwargs = kwargs
        self.staging = Path(kwargs["kv_transfer_config"]["kv_connector_extra_config"]["shared_storage_path"])
        self.layers = kwargs["speculative_config"]["draft_model_config"]["hf_config"][
            "eagle_aux_hidden_state_layer_ids"]
        self.corrupt_tokens = corrupt_tokens
        self.calls = 0

    def hidden_state_files(self, prompts):
        files = []
        for prompt in prompts:
            self.calls += 1
            path = self.staging / f"req-{self.calls}-abcd1234.safetensors"
            tokens = torch.tensor(prompt, dtype=torch.int64)
            if self.corrupt_tokens:
                tokens = tokens.flip(0)
            hs = torch.full((len(prompt), len(self.layers), 32), float(self.calls), dtype=torch.bfloat16)
            save_file({"hidden_states": hs, "token_ids": tokens}, path)
            Path(str(path) + ".lock").touch()  # vLLM leaves the lock file behind
            files.append(path)
        return files


def make_job(tmp_path: Path, tiny_verifier_dir: Path) -> tuple[ExtractionJob, Path]:
    verifier_dir, prepared = pipeline_until_prepare(tmp_path, tiny_verifier_dir)
    verifier, model_dir = load_verifier_info(verifier_dir)
    from datasets import load_from_disk

    input_ids = load_from_disk(str(prepared)).data.column("input_ids").to_pylist()
    out = tmp_path / "data" / "hidden_states"
    out.mkdir(parents=True)
    job = ExtractionJob(verifier=verifier, model_dir=model_dir,
                        params=ExtractParams(backend="vllm", tensor_parallel_size=2, gpu_memory_utilization=0.5),
                        out_dir=out, todo=list(range(len(input_ids))), input_ids=input_ids)
    return job, prepared


def test_llm_arguments(tmp_path: Path, tiny_verifier_dir: Path):
    job, _ = make_job(tmp_path, tiny_verifier_dir)
    kwargs = build_llm_kwargs(job, tmp_path / "stage")
    assert kwargs["model"] == str(tiny_verifier_dir)
    assert kwargs["speculative_config"] == {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5, 8]}},
    }
    assert kwargs["kv_transfer_config"] == {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "stage")},
    }
    assert (kwargs["tensor_parallel_size"], kwargs["gpu_memory_utilization"]) == (2, 0.5)
    assert kwargs["max_model_len"] == max(len(ids) for ids in job.input_ids) + 1
    assert kwargs["enable_chunked_prefill"] is False and kwargs["trust_remote_code"] is False
    assert kwargs["dtype"] == "bfloat16"  # the tiny checkpoint is fp32: served in bf16


def test_staging_is_a_sibling_outside_the_output(tmp_path: Path):
    out = tmp_path / "data" / "hidden_states"
    assert staging_dir_for(out) == tmp_path / "data" / "hidden_states.vllm-staging"


def test_staged_files_are_moved_into_the_layout(tmp_path: Path, tiny_verifier_dir: Path):
    job, _ = make_job(tmp_path, tiny_verifier_dir)
    engines = []
    extract_with_vllm(job, engine_factory=lambda kwargs: engines.append(FakeEngine(kwargs)) or engines[-1])
    for row in job.todo:
        data = load_file(hs_path(job.out_dir, row))
        assert data["token_ids"].tolist() == job.input_ids[row]
        assert data["hidden_states"].shape == (len(job.input_ids[row]), 4, 32)
    assert not staging_dir_for(job.out_dir).exists()  # staged files and lock files are gone


def test_token_mismatch_from_vllm_is_an_error(tmp_path: Path, tiny_verifier_dir: Path):
    job, _ = make_job(tmp_path, tiny_verifier_dir)
    with pytest.raises(EaglenestError, match=r"vLLM's token_ids differ from prepared row"):
        extract_with_vllm(job, engine_factory=lambda kwargs: FakeEngine(kwargs, corrupt_tokens=True))
    assert not list(job.out_dir.glob("hs_*.safetensors"))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_backend_without_vllm_says_how_to_install(tmp_path: Path, tiny_verifier_dir: Path):
    verifier_dir, prepared = pipeline_until_prepare(tmp_path, tiny_verifier_dir)
    with pytest.raises(EaglenestError, match=r"extract.backend: vllm needs vLLM on a GPU machine"):
        extract_hidden_states(ExtractParams(backend="vllm"), verifier_dir, prepared, tmp_path / "hs",
                              tmp_path / "m.json")


def test_vllm_is_never_imported_by_the_base_package():
    import sys

    import eaglenest.cli  # noqa: F401
    import eaglenest.extract  # noqa: F401

    assert "vllm" not in sys.modules
