"""The drafter plugin without engines: its pin on vLLM's version, its configuration, the hook that wraps vLLM's
model runner only when its module is imported, and the one line where suffix decoding is missing."""

from __future__ import annotations

import sys
import types

import pytest
from pydantic import ValidationError

from eaglenest.core.drafter import config as drafter_config
from eaglenest.core.drafter import plugin
from eaglenest.core.drafter.config import CONFIG_KEY, PINNED_VLLM, DrafterConfig, SuffixConfig, speculative_config


def test_another_vllm_version_is_refused_in_one_line_naming_both():
    with pytest.raises(RuntimeError) as err:
        drafter_config.require_pinned_vllm("0.33.0")
    line = str(err.value)
    assert "\n" not in line and PINNED_VLLM in line and "0.33.0" in line
    drafter_config.require_pinned_vllm(PINNED_VLLM)  # the pinned one passes


def _fake_runner_module() -> types.ModuleType:
    module = types.ModuleType("fake_runner")

    class GPUModelRunner:
        def __init__(self, vllm_config, device):
            self.vllm_config, self.device = vllm_config, device

    module.GPUModelRunner = GPUModelRunner
    return module


def test_an_engine_configured_for_the_drafter_stops_on_an_unpinned_vllm(monkeypatch: pytest.MonkeyPatch):
    module = _fake_runner_module()
    plugin._wrap_runner(module)
    monkeypatch.setattr(drafter_config, "installed_vllm_version", lambda: "0.31.1")
    config = types.SimpleNamespace(additional_config={CONFIG_KEY: DrafterConfig(draft_k=2).model_dump()})
    with pytest.raises(RuntimeError, match=f"patches vLLM {PINNED_VLLM}.*vLLM 0.31.1 is installed"):
        module.GPUModelRunner(config, "cpu")
    # an engine that does not configure it is vLLM's own, whatever the version
    plain = module.GPUModelRunner(types.SimpleNamespace(additional_config={}), "cpu")
    assert not hasattr(plain, "_eaglenest_drafter")


def test_the_runner_is_wrapped_once_and_only_after_its_module_is_imported(monkeypatch: pytest.MonkeyPatch, tmp_path):
    (tmp_path / "later_runner.py").write_text("class GPUModelRunner:\n    def __init__(self, c, d):\n        pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "later_runner", raising=False)
    seen = []
    plugin._when_imported("later_runner", seen.append)
    plugin._when_imported("later_runner", seen.append)  # a second registration waits for the same import
    assert seen == [] and "later_runner" not in sys.modules
    import later_runner  # noqa: F401

    assert [m.__name__ for m in seen] == ["later_runner"]
    assert not any(isinstance(f, plugin._AfterImport) and f.name == "later_runner" for f in sys.meta_path)
    module = sys.modules["later_runner"]
    plugin._wrap_runner(module)
    wrapped = module.GPUModelRunner.__init__
    plugin._wrap_runner(module)
    assert module.GPUModelRunner.__init__ is wrapped


def test_the_configuration_is_strict_and_knows_its_largest_k():
    config = DrafterConfig(draft_k=2, suffix=SuffixConfig(k=6, threshold=1.5))
    assert config.max_k == 6 and DrafterConfig(draft_k=3).max_k == 3
    with pytest.raises(ValidationError):
        DrafterConfig.model_validate({"draft_k": 2, "threshold": 1.0})
    with pytest.raises(ValidationError):
        DrafterConfig(draft_k=0)
    spec = speculative_config("models/draft", config, [[1, 1, 6], [2, 8, 0]])
    assert spec["method"] == "eagle3" and spec["num_speculative_tokens"] == 6
    assert spec["disable_padded_drafter_batch"] is True
    assert spec["suffix_decoding_max_tree_depth"] == 24 and spec["num_speculative_tokens_per_batch_size"][1] == [
        2,
        8,
        0,
    ]
    assert (
        drafter_config.engine_drafter_config(types.SimpleNamespace(additional_config={CONFIG_KEY: config.model_dump()}))
        == config
    )
    assert drafter_config.engine_drafter_config(types.SimpleNamespace(additional_config={})) is None


def test_a_hybrid_without_suffix_decoding_installed_stops_in_one_line(monkeypatch: pytest.MonkeyPatch):
    from eaglenest.core.drafter.runner import SUFFIX_MISSING, Drafter

    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)  # import fails
    runner = types.SimpleNamespace(num_spec_tokens=4)
    with pytest.raises(RuntimeError) as err:
        Drafter(runner, DrafterConfig(draft_k=2, suffix=SuffixConfig(k=4, threshold=1.0)))
    assert str(err.value) == SUFFIX_MISSING and "make setup" in SUFFIX_MISSING
    Drafter(runner, DrafterConfig(draft_k=2))  # the draft alone needs no suffix decoding
