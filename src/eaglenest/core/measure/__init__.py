"""The vLLM measurement kit: what evaluate, the k_sweep stage and ``eaglenest bench`` measure speculative decoding
with, so that the three report one speed-up and one tau for the same draft, prompts and K.

* :mod:`~eaglenest.core.measure.engines` — the plain, draft (EAGLE-3) and n-gram engines' arguments from the
  engine params, their KV cache sized to the prompts (the longest requests in flight, each its prompt plus
  ``max_new_tokens`` plus K+1 draft slots), their start (warmed up, every timed prompt's length met once) and stop,
  and the K rule (the K given, else the draft's own);
* :mod:`~eaglenest.core.measure.spec_counters` — vLLM's speculative-decoding counters, one list of names, read from
  an engine (``llm.get_metrics()``), from a server's ``/metrics`` text, and from one request's own counts, with the
  checks that they describe one decoding;
* :mod:`~eaglenest.core.measure.single_stream` — interleaved single-stream timing: each prompt alone on every engine,
  the engines taking turns prompt by prompt, prefill included;
* :mod:`~eaglenest.core.measure.speedup` — the speed-up (tokens/s over the plain engine's) with its 95% interval,
  a bootstrap over prompts (:mod:`eaglenest.core.bootstrap`).

Nothing here reads a stage's files: the callers pass the draft's own K and its ``speculative_config``
(:mod:`eaglenest.artifacts.draft`). vLLM is imported only once an engine has started.
"""
