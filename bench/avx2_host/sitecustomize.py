"""Makes this machine compute as a CPU without AVX512 does, for timing the project as such a host runs it.

Loaded by ``bench/avx2_host.sh`` through PYTHONPATH (Python imports ``sitecustomize`` at start-up, in every
process: the stages, DVC's children, vLLM's engine). It limits torch's own kernels (``ATEN_CPU_CAPABILITY``) and
oneDNN's (``ONEDNN_MAX_CPU_ISA``) to AVX2, and makes torch report no AVX512, AVX512-BF16 or AMX, so that
eaglenest's ``auto`` precisions choose float32 and vLLM's CPU build loads its AVX2 kernels (``vllm._C_AVX2``).
What it cannot change is the core itself (clock, caches, memory): an AVX2-only CPU of another generation is
slower or faster by that much, so a time measured here is a simulation and is recorded as one.
"""

import importlib.abc
import importlib.util
import os
import sys

os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
os.environ.setdefault("EAGLENEST_SIMULATED_HOST", "avx2")

HIDDEN = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported", "_is_amx_tile_supported",
          "_is_amx_fp16_supported")


class _NoAvx512(importlib.abc.MetaPathFinder):
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


sys.meta_path.insert(0, _NoAvx512())
