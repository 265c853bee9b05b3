"""The hidden states the extract stage writes and convert, train, export and inspect read: one owner of their
layout.

* :mod:`.format` — one file: names (``hs_{i}``, ``shard_{s}``), tensors, metadata, header and row checks; a file
  that cannot be read as expected raises :class:`~.format.HiddenStateFileError`.
* :mod:`.layout` — the shard plan, :class:`~.layout.HiddenStatePlan` (every file of an extraction and what each
  must hold: extract writes from it, resume checks against it), and each file's bytes laid out before any row is
  computed, written row by row at their offsets (to a file, or to a buffer a Ray worker returns).
* :mod:`.resume` — an extraction while it runs: finished files kept in ``data/hidden_states.unfinished/``,
  checked and reused by the next run, moved into the output when all are there.
* :mod:`.reader` — reading a finished folder: its layout from the files' headers, where each row lives, a row.
* :mod:`.online` — ``extract.store: online``'s manifest.
"""
