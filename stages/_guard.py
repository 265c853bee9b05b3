"""Shared by every stage script: make sure this is the project's interpreter before heavy imports.

Standard library only. ``src/`` goes on sys.path so the check (``eaglenest.core.environment``, itself
stdlib-only) can run even in an interpreter where eaglenest is not installed.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from eaglenest.core.environment import require_stage_environment  # noqa: E402

__all__ = ["require_stage_environment"]
