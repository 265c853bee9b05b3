"""Reading a JSON file that a stage wrote: the document, or one line that names the file and what to run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eaglenest.core.errors import InputFileError


def read_json(path: Path, missing: str, fix: str, named: str | None = None) -> Any:
    """The JSON document in ``path``.

    Args:
        path: The file.
        missing: The message where there is no file (what writes it).
        fix: What the user runs where the file is not readable JSON.
        named: How the message names the file (default: its path).

    Raises:
        InputFileError: no file (``missing``), or a file that is not readable JSON (one line naming it, with
            ``fix``).
    """
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise InputFileError(missing) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputFileError(f"{named or path}: not readable JSON ({err}); {fix}") from None
