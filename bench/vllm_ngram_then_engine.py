"""A minimal reproduction (run by hand) of a vLLM CPU-build failure: no engine starts in a process that has
imported numba (as vLLM's own n-gram proposer does), and eaglenest's workaround.

    .venv/bin/python bench/vllm_ngram_then_engine.py             # with eaglenest's workaround: the engine starts
    .venv/bin/python bench/vllm_ngram_then_engine.py --bare      # vLLM as it is: AttributeError, no engine

Run in a checkout whose verifier stage has run (``models/verifier``). It imports vLLM's n-gram proposer (which
imports numba, which imports llvmlite), then starts one plain engine with its core in this process. vLLM's CPU
build registers its kernel overrides at engine start by scanning every module's namespace with
``vars(value).get("kernel")``; llvmlite's ``ffi.lib`` answers every attribute, ``__dict__`` too, with a function
wrapper, so the scan stops with ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``. The same
happens to any engine started after an n-gram engine in one process, and in a process forked from one.
eaglenest starts every engine with ``llvmlite.binding.ffi`` out of ``sys.modules``
(``eaglenest.core.vllm_support._without_llvmlite_ffi``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bare", action="store_true", help="start the engine with vLLM's own LLM(), no workaround")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    import vllm.v1.spec_decode.ngram_proposer  # noqa: F401  (imports numba, and with it llvmlite)

    kwargs = {
        "model": str(Path("models/verifier").resolve()),
        "max_model_len": 256,
        "enforce_eager": True,
        "kv_cache_memory_bytes": 64 << 20,
    }
    if args.bare:
        from vllm import LLM

        LLM(**kwargs)
    else:
        from eaglenest.core.vllm_support import create_llm

        create_llm(kwargs, "bench")
    print("the engine started")
    return 0


if __name__ == "__main__":
    sys.exit(main())
