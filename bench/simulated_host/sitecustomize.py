"""Makes this machine compute as another CPU kind does, for timing or reproducing the project as such a host runs it.

Loaded by ``bench/avx2_host.sh`` and ``bench/avx512_host.sh`` through PYTHONPATH (Python imports ``sitecustomize``
at start-up, in every process: the stages, DVC's children, vLLM's engine), which name the kind in
``EAGLENEST_SIMULATED_HOST`` (recorded by :func:`eaglenest.core.host.host_kind`):

* ``avx2`` — a CPU without AVX512: torch's own kernels (``ATEN_CPU_CAPABILITY``) and oneDNN's
  (``ONEDNN_MAX_CPU_ISA``) held to AVX2, and torch reporting no AVX512, AVX512-BF16 or AMX, so that eaglenest's
  ``auto`` precisions choose float32 and vLLM's CPU build loads its AVX2 kernels (``vllm._C_AVX2``);
* ``avx512-bf16`` — a CPU with AVX512 and AVX512-BF16 but no AMX (an AMD EPYC of the Zen 4 or 5 generation):
  oneDNN held to AVX512 with bf16 and torch reporting no AMX, so that vLLM's CPU attention takes its AVX512
  kernels (``vec``) instead of its AMX ones.

What it cannot change is the core itself (clock, caches, memory): another generation's CPU of that kind is slower
or faster by that much, and its kernels may block work differently, so a time or a byte measured here is a
simulation and is recorded as one.
"""

import importlib.abc
import importlib.util
import os
import sys

# kind -> (environment it sets where unset, torch.cpu capability probes it makes answer False)
KINDS = {
    "avx2": (
        {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
        (
            "_is_avx512_supported",
            "_is_avx512_bf16_supported",
            "_is_avx512_vnni_supported",
            "_is_amx_tile_supported",
            "_is_amx_fp16_supported",
        ),
    ),
    "avx512-bf16": ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, ("_is_amx_tile_supported", "_is_amx_fp16_supported")),
}
KIND = os.environ.setdefault("EAGLENEST_SIMULATED_HOST", "avx2")
if KIND not in KINDS:
    raise SystemExit(f"EAGLENEST_SIMULATED_HOST={KIND}: allowed: {', '.join(KINDS)}")
ENVIRONMENT, HIDDEN = KINDS[KIND]
for key, value in ENVIRONMENT.items():
    os.environ.setdefault(key, value)


class _Hidden(importlib.abc.MetaPathFinder):
    """Patches ``torch.cpu``'s capability probes as that module is first imported."""

    def find_spec(self, name, path, target=None):
        if name != "torch.cpu":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            for probe in HIDDEN:
                if hasattr(module, probe):
                    setattr(module, probe, lambda: False)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Hidden())
