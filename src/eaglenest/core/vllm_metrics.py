"""The names of vLLM's speculative-decoding counters, which evaluate reads from its engine and ``eaglenest bench``
from a server's ``/metrics``.

vLLM defines them in ``vllm/v1/spec_decode/metrics.py`` (and ``vllm/v1/metrics/loggers.py``); these are the family
names, as ``get_metrics()`` and prometheus_client's parser give them, without the ``_total`` of their samples.
Nothing here imports vLLM.
"""

from __future__ import annotations

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
