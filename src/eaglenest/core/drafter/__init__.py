"""eaglenest's drafter inside vLLM: the EAGLE-3 draft with an exact catch-up, alone or in a hybrid with suffix
decoding, loaded by vLLM as a general plugin (``vllm.general_plugins`` entry point ``eaglenest_drafter``).

vLLM's own EAGLE proposer runs the draft over every token the verifier took at every step, also where it drafts
nothing (K = 0 in a K-per-batch-size schedule): the draft's KV cache must see every position, or its later
proposals lose their acceptance. This drafter keeps each request's unseen positions instead (the token, its position,
the verifier's hidden states at the aux layers and the KV slot) and feeds them to the draft the next time that request
needs a proposal, in one forward with the new ones. So a step that needs no draft costs no draft forward, and the
draft's cache is the one a fresh run over the same prefix would hold (:mod:`eaglenest.core.drafter.runner`).

With ``suffix`` configured it is a hybrid: each step, per request, suffix decoding's continuation (Arctic Inference's
``SuffixDecodingCache``, fed as vLLM's ``method: suffix`` feeds it) where its score (the sum of its tokens'
probabilities in the suffix tree, the tokens it expects accepted) reaches ``suffix.threshold``, else the draft's.

Enabled only where an engine's ``additional_config`` holds :data:`CONFIG_KEY` (:class:`DrafterConfig` as a dict),
beside ``speculative_config = {"method": "eagle3", "model": DRAFT, "num_speculative_tokens": K_MAX,
"disable_padded_drafter_batch": true, ...}`` (:func:`speculative_config` builds both); any other engine is vLLM's
own. It patches vLLM's model runner and holds to :data:`PINNED_VLLM` alone: another version, with it configured, stops
with one line naming both (:func:`require_pinned_vllm`). Nothing here imports vLLM until an engine is built.


Its settings and vLLM's configuration for it live in :mod:`.config`, the entry point in :mod:`.plugin`, the work
inside the model runner in :mod:`.runner`.
"""
