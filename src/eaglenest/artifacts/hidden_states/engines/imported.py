"""The ``import`` extract back end: hidden states another tool computed, checked and copied in.

``extract.import_path`` holds ``hs_{row}.safetensors`` files in the shared format (vLLM's hidden-states
connector, ``speculators``' data generation, an earlier eaglenest run). Each is checked against the prepared
row (tokens, shape, finite values) and stored with eaglenest's metadata in ``extract.dtype``, in the layout of
``extract.rows_per_shard``. It reads files on this machine, so it always runs in the stage's own process.
"""

from __future__ import annotations

from pathlib import Path

from eaglenest.artifacts.hidden_states.engines.contract import EngineSettings, RowWriter
from eaglenest.artifacts.hidden_states.format import HIDDEN_KEY, hs_path, read_hidden_state_file
from eaglenest.core.errors import EaglenestError


class ImportEngine:
    """The folder of another tool's row files."""

    name = "import"

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.source = Path(settings.params.import_path or "")
        if not self.source.is_dir():
            raise EaglenestError(f"extract.import_path = {str(self.source)!r}: no such folder")

    def compute(self, rows: list[int], input_ids: dict[int, list[int]], write: RowWriter) -> None:
        """Copies each row's file, checking tokens, shape and values; any float dtype becomes ``extract.dtype``."""
        for row in rows:
            path = hs_path(self.source, row)
            data = read_hidden_state_file(path, input_ids[row], self.settings.verifier, None)  # a bad file: its line
            write(row, data[HIDDEN_KEY])
