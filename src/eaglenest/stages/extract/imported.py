"""The ``import`` extract back end: hidden states another tool computed, checked and copied in.

``extract.import_path`` holds ``hs_{row}.safetensors`` files in the shared format (vLLM's hidden-states
connector, ``speculators``' data generation, an earlier eaglenest run). Each is checked against the prepared
row (tokens, shape, finite values) and rewritten with eaglenest's metadata in ``extract.dtype``.
"""

from __future__ import annotations

from pathlib import Path

from eaglenest.artifacts.hidden_states import HIDDEN_KEY, hs_path, read_hidden_state_file
from eaglenest.core.errors import EaglenestError
from eaglenest.stages.extract.job import ExtractionJob


def copy_hidden_state_files(job: ExtractionJob) -> None:
    """Copies ``hs_{row}.safetensors`` from extract.import_path, checking tokens, shape and values."""
    source = Path(job.params.import_path or "")
    if not source.is_dir():
        raise EaglenestError(f"extract.import_path = {str(source)!r}: no such folder")
    for row in job.todo:
        path = hs_path(source, row)
        # Any float dtype is accepted here: job.write converts to extract.dtype.
        problem, data = read_hidden_state_file(path, job.input_ids[row], job.verifier, None)
        if problem is not None:
            raise EaglenestError(f"{path}: {problem}")
        job.write(row, data[HIDDEN_KEY])
