"""What every test shares: an offline, isolated DVC, Ray on loopback, the vLLM marker, and the fixture layers
(``tests/fixtures``): the suite on several workers (``workers``), tiny models (``models``), then pipelines on them
and on the real default verifier (``pipeline``), a Ray cluster of several nodes on this machine (``cluster``),
then fakes of servers and engines (``fakes``) and a real bench sweep against them (``bench``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest_plugins = (
    "tests.fixtures.workers",
    "tests.fixtures.models",
    "tests.fixtures.pipeline",
    "tests.fixtures.cluster",
    "tests.fixtures.bench",
)

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
# Every Ray cluster of the tests is on this machine: nodes on 127.0.0.1 (read when Ray is first imported, so set
# before any test imports it), no usage statistics, clients authenticated with a token.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["RAY_AUTH_MODE"] = "token"


@pytest.fixture(autouse=True)
def _isolated_dvc(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """DVC's site cache and analytics stay out of the user's machine."""
    monkeypatch.setenv("DVC_SITE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "dvc-site-cache"))
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")


@pytest.fixture(autouse=True)
def _isolated_weight_hashes(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process verifier stages remember weight hashes in the session's temp folder, not the checkout."""
    from eaglenest.stages import verifier

    monkeypatch.setattr(verifier, "WEIGHT_HASH_CACHE", tmp_path_factory.getbasetemp() / "weight-hashes.json")


# --- Real vLLM ------------------------------------------------------------------------------------------
# The vLLM tests run whenever vLLM is installed (`make setup` installs its CPU build on a machine without a
# GPU) and are skipped, with the reason, only where it is absent.
def _vllm_absent_reason() -> str | None:
    from eaglenest.core.vllm_support import installed_build

    build = installed_build()
    return None if build is not None else "vLLM is not installed (make setup VLLM=cpu|gpu installs it)"


requires_vllm = pytest.mark.skipif(_vllm_absent_reason() is not None, reason=str(_vllm_absent_reason()))


@pytest.fixture
def native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU that multiplies bf16 in hardware, whatever this machine's is (vLLM's dtype auto is bf16 there)."""
    from eaglenest.core import device

    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: True)


@pytest.fixture
def pipeline_folders(tmp_path: Path, tiny_verifier_dir: Path) -> tuple[Path, Path]:
    """A verifier stage record pointing at the tiny verifier, and a minimal EAGLE-3 speculators draft (K = 3)."""
    verifier = tmp_path / "models" / "verifier"
    verifier.mkdir(parents=True)
    (verifier / "verifier.json").write_text(
        json.dumps(
            {
                "source": str(tiny_verifier_dir),
                "kind": "local",
                "path": str(tiny_verifier_dir),
                "name": "tiny/llama",
                "fingerprint": "0" * 64,
                "model_type": "llama",
                "num_layers": 8,
                "hidden_size": 32,
                "vocab_size": 300,
                "max_position_embeddings": 512,
                "aux_layers": [2, 4, 5],
                "layer_ids": [2, 4, 5, 8],
                "trust_remote_code": False,
            }
        )
    )
    draft = tmp_path / "models" / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(
        json.dumps(
            {
                "speculators_model_type": "eagle3",
                "speculators_config": {"proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}]},
            }
        )
    )
    (draft / "model.safetensors").write_bytes(b"")
    return verifier, draft
