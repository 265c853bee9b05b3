"""The vllm extract back end without a GPU: the LLM arguments it builds, and each staged file into its place."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglenest.artifacts.hidden_states.engines.contract import EngineSettings
from eaglenest.artifacts.hidden_states.engines.vllm import (
    WAVES_PER_CALL,
    VllmExtractEngine,
    build_llm_kwargs,
    read_staged,
    staging_dir_for,
)
from eaglenest.artifacts.hidden_states.extract_params import ExtractParams
from eaglenest.artifacts.hidden_states.format import file_metadata, hs_path
from eaglenest.artifacts.hidden_states.layout import file_layout, shard_plan
from eaglenest.artifacts.verifier import load_verifier_info
from eaglenest.core.errors import EaglenestError
from eaglenest.core.params import VllmEngineParams
from eaglenest.core.vllm_support import VllmBuild
from eaglenest.stages.extract import extract_hidden_states
from eaglenest.stages.extract.job import ExtractTask, run_extract_task
from tests.conftest import requires_vllm
from tests.fixtures.pipeline import pipeline_until_prepare


class FakeEngine:
    """Stands in for vllm.LLM: writes staged files the way ExampleHiddenStatesConnector does."""

    def __init__(self, kwargs: dict, corrupt_tokens: bool = False) -> None:
        self.kwargs = kwargs
        self.staging = Path(kwargs["kv_transfer_config"]["kv_connector_extra_config"]["shared_storage_path"])
        self.layers = kwargs["speculative_config"]["draft_model_config"]["hf_config"][
            "eagle_aux_hidden_state_layer_ids"
        ]
        self.corrupt_tokens = corrupt_tokens
        self.calls = 0
        self.call_sizes: list[int] = []

    def hidden_state_files(self, prompts):
        self.call_sizes.append(len(prompts))
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


class Job:
    """The engine's settings, every row's tokens, and the task of writing every row's file into ``out``."""

    def __init__(self, tmp_path: Path, tiny_verifier_dir: Path, max_num_seqs: int = 64) -> None:
        verifier_dir, _ = pipeline_until_prepare(tmp_path, tiny_verifier_dir)
        verifier, model_dir = load_verifier_info(verifier_dir)
        from datasets import load_from_disk

        self.input_ids = load_from_disk(str(tmp_path / "data" / "prepared")).data.column("input_ids").to_pylist()
        self.out = tmp_path / "data" / "hidden_states"
        self.settings = EngineSettings(
            verifier,
            model_dir,
            ExtractParams(
                backend="vllm",
                vllm=VllmEngineParams(tensor_parallel_size=2, gpu_memory_utilization=0.5),
                max_num_seqs=max_num_seqs,
            ),
            max(len(ids) for ids in self.input_ids),
            staging=staging_dir_for(self.out),
        )
        metadata = file_metadata("c", verifier.layer_ids, "bfloat16", "vllm")
        layouts = tuple(
            file_layout(
                spec, [self.input_ids[spec.number]], len(verifier.layer_ids), verifier.hidden_size, "bfloat16", metadata
            )
            for spec in shard_plan(len(self.input_ids), 1)
        )
        self.task = ExtractTask(layouts, "bfloat16", self.out)
        self.rows = list(range(len(self.input_ids)))

    def engine(self, engines: list[FakeEngine] | None = None, **fake: bool) -> VllmExtractEngine:
        engines = [] if engines is None else engines
        return VllmExtractEngine(
            self.settings, engine_factory=lambda kwargs: engines.append(FakeEngine(kwargs, **fake)) or engines[-1]
        )


@pytest.mark.parametrize("kind", ["cpu", "gpu"])
def test_llm_arguments(
    tmp_path: Path, tiny_verifier_dir: Path, monkeypatch: pytest.MonkeyPatch, kind: str, native_bf16: None
):
    monkeypatch.setattr("eaglenest.core.vllm_support.installed_build", lambda: VllmBuild(kind, "vllm", "0"))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    job = Job(tmp_path, tiny_verifier_dir)
    kwargs = build_llm_kwargs(job.settings, tmp_path / "stage")
    assert kwargs["model"] == str(tiny_verifier_dir)
    assert kwargs["speculative_config"] == {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5, 8]}},
    }
    assert kwargs["kv_transfer_config"] == {
        "kv_connector": "EaglenestHiddenStatesConnector",
        "kv_connector_module_path": "eaglenest.artifacts.hidden_states.engines.vllm_connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "stage")},
    }
    assert kwargs["tensor_parallel_size"] == 2
    if kind == "gpu":
        assert kwargs["gpu_memory_utilization"] == 0.5 and "enforce_eager" not in kwargs
    else:  # the CPU build: no GPU memory to share, eager graphs, a KV cache sized by the environment
        assert "gpu_memory_utilization" not in kwargs and kwargs["enforce_eager"] is True
        assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert kwargs["max_model_len"] == max(len(ids) for ids in job.input_ids) + 1
    assert kwargs["enable_chunked_prefill"] is False and kwargs["trust_remote_code"] is False
    assert kwargs["dtype"] == "bfloat16"  # the tiny checkpoint is fp32: served in bf16


def test_staging_is_a_sibling_outside_the_output(tmp_path: Path):
    out = tmp_path / "data" / "hidden_states"
    assert staging_dir_for(out) == tmp_path / "data" / "hidden_states.vllm-staging"


def test_staged_files_go_into_the_layout(tmp_path: Path, tiny_verifier_dir: Path):
    job = Job(tmp_path, tiny_verifier_dir)
    engine = job.engine()
    written = run_extract_task(engine, job.task)
    engine.close()
    assert sorted(name for name, _ in written) == sorted(hs_path(Path(), row).name for row in job.rows)
    for row in job.rows:
        data = load_file(hs_path(job.out, row))
        assert data["token_ids"].tolist() == job.input_ids[row]
        assert data["hidden_states"].shape == (len(job.input_ids[row]), 4, 32)
    assert not staging_dir_for(job.out).exists()  # staged files and lock files are gone


def test_an_engine_that_fails_to_start_leaves_no_staging(tmp_path: Path, tiny_verifier_dir: Path):
    job = Job(tmp_path, tiny_verifier_dir)

    def failing_engine(kwargs: dict) -> FakeEngine:
        raise EaglenestError("extract.backend: vllm could not start")

    with pytest.raises(EaglenestError, match="could not start"):
        VllmExtractEngine(job.settings, engine_factory=failing_engine)
    assert not staging_dir_for(job.out).exists()


def test_rows_go_to_vllm_a_few_waves_per_call(tmp_path: Path, tiny_verifier_dir: Path):
    """Rows go to vLLM in calls of WAVES_PER_CALL x max_num_seqs rows, which bound the staging folder's size."""
    job = Job(tmp_path, tiny_verifier_dir, max_num_seqs=1)
    engines: list[FakeEngine] = []
    run_extract_task(job.engine(engines), job.task)
    rows = len(job.rows)
    assert rows > WAVES_PER_CALL
    assert engines[0].call_sizes == [WAVES_PER_CALL] * (rows // WAVES_PER_CALL) + (
        [rows % WAVES_PER_CALL] if rows % WAVES_PER_CALL else []
    )
    assert engines[0].kwargs["max_num_seqs"] == 1


def test_token_mismatch_from_vllm_is_an_error(tmp_path: Path, tiny_verifier_dir: Path):
    job = Job(tmp_path, tiny_verifier_dir)
    with pytest.raises(EaglenestError, match=r"vLLM's token_ids differ from prepared row"):
        run_extract_task(job.engine(corrupt_tokens=True), job.task)
    assert not list(job.out.iterdir())  # not a file, not a temporary


def test_vllm_backend_without_vllm_says_how_to_install(
    tmp_path: Path, tiny_verifier_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    # Runs whether or not vLLM is installed here: the check reads only the installation's metadata.
    monkeypatch.setattr("eaglenest.core.vllm_support.installed_build", lambda: None)
    verifier_dir, prepared = pipeline_until_prepare(tmp_path, tiny_verifier_dir)
    with pytest.raises(
        EaglenestError,
        match=r"^extract.backend: vllm needs vLLM, which this interpreter lacks; "
        r"install vLLM's (CPU|GPU) build: .*or set extract.backend: hf$",
    ):
        extract_hidden_states(
            ExtractParams(backend="vllm"), verifier_dir, prepared, tmp_path / "hs", tmp_path / "m.json"
        )
    assert not staging_dir_for(tmp_path / "hs").exists()  # refused before anything was staged


def test_vllm_is_never_imported_by_the_base_package():
    # A fresh interpreter: other tests of the same pytest run may have imported vllm already.
    code = (
        "import sys, eaglenest.commands.cli, eaglenest.stages.extract, eaglenest.artifacts.hidden_states.engines.vllm; "
        "print('vllm' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


@requires_vllm
def test_connector_writes_a_cpu_buffer_in_block_order(tmp_path: Path):
    """The CPU write path on a synthetic buffer: a request's blocks out of order, its last block part-filled."""
    import fcntl
    from concurrent.futures import ThreadPoolExecutor

    from eaglenest.artifacts.hidden_states.engines import vllm as extract_vllm
    from eaglenest.artifacts.hidden_states.engines import vllm_connector
    from eaglenest.artifacts.hidden_states.engines.vllm_connector import EaglenestHiddenStatesConnector, PendingSave

    # extract_vllm names the connector by strings (importing it would import vllm): they must find it
    assert getattr(vllm_connector, extract_vllm.CONNECTOR_NAME) is EaglenestHiddenStatesConnector
    assert vllm_connector.__name__ == extract_vllm.CONNECTOR_MODULE

    blocks, slots, block_size, hidden = 6, 3, 4, 5
    kv_cache = torch.randn(blocks, slots, block_size, hidden)  # [num_blocks, n, bs, hidden], as vLLM lays it out
    connector = object.__new__(EaglenestHiddenStatesConnector)  # the engine's config is not needed for a write
    connector._kv_cache, connector._block_size, connector._is_tp_rank_zero = kv_cache, block_size, True
    connector._req_futures, connector._req_copy_events, connector._lock_fds = {}, {}, {}
    connector.use_lock = True
    connector._executor = ThreadPoolExecutor(1)
    path = tmp_path / "req-1.safetensors"
    lock_fd = os.open(str(path) + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)  # as wait_for_save pre-creates it
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    connector._lock_fds["req-1"] = lock_fd

    tokens = torch.arange(6, dtype=torch.int64)
    # Tokens 0-3 sit in block 4, tokens 4-5 in the first two slots of block 1.
    expected = torch.cat([kv_cache[4], kv_cache[1, :, :2]], dim=1).permute(1, 0, 2).clone()  # [6, n, hidden]
    connector._submit_async_write(PendingSave("req-1", str(path), tokens, block_ids=[4, 1]))
    assert connector._req_copy_events["req-1"].query()  # get_finished may report the request at once
    kv_cache.zero_()  # the blocks are reused once reported: the write must not read them any more

    data = read_staged(path)  # waits for the writer's lock
    connector._executor.shutdown(wait=True)
    assert torch.equal(data["token_ids"], tokens)
    assert torch.equal(data["hidden_states"], expected)
    assert not path.exists() and not Path(str(path) + ".lock").exists()
