"""Makes this machine compute as a CPU with AVX512 and AVX512-BF16 but no AMX does (an AMD EPYC of the Zen 4 or 5
generation), for reproducing on an Intel Xeon with AMX what such a host computes.

Loaded by ``bench/avx512_host.sh`` through PYTHONPATH (Python imports ``sitecustomize`` at start-up, in every
process: the stages, DVC's children, vLLM's engine). It limits oneDNN's kernels (``ONEDNN_MAX_CPU_ISA``) to
AVX512 with bf16 and makes torch report no AMX, so that vLLM's CPU build picks its AVX512 attention kernels
(``vec``) instead of its AMX ones and oneDNN its AVX512-BF16 GEMMs. What it cannot change is the core itself
(clock, caches, memory), so a time measured here is a simulation and is recorded as one.
"""

import importlib.abc
import importlib.util
import os
import sys

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
os.environ.setdefault("EAGLENEST_SIMULATED_HOST", "avx512-bf16")

HIDDEN = ("_is_amx_tile_supported", "_is_amx_fp16_supported")


class _NoAmx(importlib.abc.MetaPathFinder):
    """Patches ``torch.cpu``'s AMX probes as that module is first imported."""

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


sys.meta_path.insert(0, _NoAmx())
