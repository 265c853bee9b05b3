"""The hf extract back end on a CUDA GPU (``extract.device: auto``): the same hidden states as the CPU's float32
ones, within bf16's rounding. Skipped without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eaglenest.artifacts.hidden_states.extract_params import ExtractParams
from eaglenest.stages.extract import extract_hidden_states
from tests.fixtures.pipeline import pipeline_until_prepare, stored_row

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (extract.device auto: the verifier in bf16 on CUDA)"
)

# The GPU computes in bf16 (8 significant bits: a relative step of 2^-8 per rounding) through the tiny verifier's
# 8 layers, the CPU in float32: each slot may differ by a few bf16 steps of its largest value (the same model in
# bf16 on the CPU: 1.0e-2 at most), never by the whole value as a wrong layer or padding would.
BF16_TOLERANCE = 3e-2


def test_gpu_hidden_states_match_the_cpu_float32_ones(tmp_path: Path, tiny_verifier_dir: Path):
    verifier_dir, prepared = pipeline_until_prepare(tmp_path, tiny_verifier_dir, rows=16)
    runs = {}
    for device in ("cpu", "auto"):
        # Stored in float32 both: only the arithmetic differs. Small batches pad rows on both devices.
        runs[device] = extract_hidden_states(
            ExtractParams(device=device, dtype="float32", batch_tokens=200),
            verifier_dir,
            prepared,
            tmp_path / device,
            tmp_path / f"{device}.json",
        )
    gpu_host = runs["auto"]["host"]
    assert gpu_host["gpu"].endswith(torch.cuda.get_device_name(0)), gpu_host
    assert gpu_host["compute_dtype"] == "bfloat16" and runs["cpu"]["host"]["compute_dtype"] == "float32"

    worst = 0.0
    for row in range(runs["cpu"]["rows"]):
        cpu, gpu = stored_row(tmp_path / "cpu", row), stored_row(tmp_path / "auto", row)
        assert torch.equal(cpu["token_ids"], gpu["token_ids"])
        expected, actual = cpu["hidden_states"], gpu["hidden_states"]  # [seq, n_aux + 1, hidden], float32
        assert actual.shape == expected.shape and actual.dtype == torch.float32
        assert torch.isfinite(actual).all()
        # each layer slot against its own scale: later layers grow
        scale = expected.abs().amax(dim=(0, 2))  # [n_aux + 1]
        worst = max(worst, ((actual - expected).abs().amax(dim=(0, 2)) / scale).max().item())
        assert not torch.equal(actual, expected)  # really computed elsewhere, in bf16
    print(
        f"\ncuda extract: {runs['auto']['rows']} rows, {runs['auto']['tokens_per_s']} tokens/s on "
        f"{gpu_host['gpu']} ({runs['cpu']['tokens_per_s']} on the CPU); largest difference from the CPU's float32, "
        f"relative to the slot's largest value: {worst:.3g}"
    )
    assert worst < BF16_TOLERANCE
