"""The hidden states the extract stage writes (or a stream computes) and convert, train, export and inspect read:
one owner of their layout and of how they are computed.

* :mod:`.format` — one file: names (``hs_{i}``, ``shard_{s}``), tensors, metadata, header and row checks; a file
  that cannot be read as expected raises :class:`~.format.HiddenStateFileError`.
* :mod:`.layout` — the shard plan, :class:`~.layout.HiddenStatePlan` (every file of an extraction and what each
  must hold: extract writes from it, resume checks against it), and each file's bytes laid out before any row is
  computed, written row by row at their offsets (to a file, or to a buffer a Ray worker returns).
* :mod:`.resume` — an extraction while it runs: finished files kept in ``data/hidden_states.unfinished/``,
  checked and reused by the next run, moved into the output when all are there.
* :mod:`.reader` — reading a finished folder: its layout from the files' headers, where each row lives, a row.
* :mod:`.online` — the manifest of ``extract.store: online`` and ``stream`` (nothing stored).
* :mod:`.extract_params` — ``extract:``'s schema: how hidden states are computed and stored.
* :mod:`.engines` — the back ends that compute hidden states (hf, vllm, import), their contract and registry.
* :mod:`.stream` — ``extract.store: stream``: engines on an executor computing training's batches, in its order.
"""
