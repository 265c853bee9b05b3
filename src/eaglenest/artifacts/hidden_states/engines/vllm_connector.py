"""A hidden-states connector that also writes on the CPU; vLLM loads it by module path.

vLLM's ``extract_hidden_states`` speculative method caches the verifier's hidden states at the requested
layers in a KV-cache-like buffer, and a KV connector writes them out when a request finishes. The built-in
``ExampleHiddenStatesConnector`` copies that buffer to the host on a CUDA stream into pinned memory and
waits on a ``torch.cuda.Event``, so on vLLM's CPU build every request fails ("pin_memory=True requires a
CUDA or other accelerator backend").

:class:`EaglenestHiddenStatesConnector` subclasses it and replaces only that copy when the buffer lives on
the CPU: the rows are gathered with the same slot mapping and cloned (the buffer's blocks are freed and
reused once the request is reported finished), and the write thread gets an already-completed event. On a
GPU it defers to the parent unchanged. The extract back end selects it with
``kv_transfer_config={"kv_connector": "EaglenestHiddenStatesConnector", "kv_connector_module_path":
"eaglenest.artifacts.hidden_states.engines.vllm_connector", ...}``; speculators' ``hs_connectors`` package
extends the same parent the same way. This module imports vllm, so only vLLM's engine imports it.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class CompletedEvent:
    """Stands in for the CUDA event of a host copy that has, on the CPU, already happened."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class EaglenestHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` with a CPU write path; same files, same lock protocol."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        """Writes ``pending``'s hidden states from a CPU buffer; any other device goes to the parent."""
        if self._kv_cache is None or self._kv_cache.device.type != "cpu":
            super()._submit_async_write(pending)
            return
        if not self._is_tp_rank_zero:
            return
        # The slots of the request's blocks, in order: block b holds tokens [b*bs, (b+1)*bs).
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)  # [num_blocks]
        offsets = torch.arange(self._block_size, dtype=torch.long)  # [bs]
        slot_mapping = (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()  # [num_blocks*bs]
        num_tokens = pending.token_ids.shape[0]
        # The buffer is [num_blocks, n, bs, hidden] (n layer ids as "heads"); indexing copies the rows
        # out, which must happen now: the blocks go back to the allocator as soon as get_finished reports this
        # request. clone keeps only the request's tokens (the copy also holds its last block's unused slots).
        hidden_states = extract_from_kv_cache(self._kv_cache, slot_mapping, num_tokens).clone()  # [seq, n, hidden]
        tensors = {"hidden_states": hidden_states, "token_ids": pending.token_ids.clone()}

        assert self._req_futures.get(pending.req_id) is None, "Found another KV transfer request with same req_id!"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done: Any = CompletedEvent()  # stands in for the torch Event the parent waits on
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
