"""The draft's identity: the sha256 every record of a measurement on one draft is keyed by (its K, its schedule,
its hybrid, its serving plan), so that a retrained draft is never served with another's."""

from __future__ import annotations

import hashlib
from pathlib import Path


def draft_fingerprint(draft_dir: Path) -> str:
    """sha256 of the draft's config.json and weights: what a record was measured on."""
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        with open(draft_dir / name, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()
