"""``extract.store: online`` and ``stream``: no hidden states are stored; the extract stage writes a manifest
instead, so that DVC still sees an output change exactly when the rows, the verifier, its layers or the dtype change,
and the train stage can refuse to compute hidden states for data the manifest was not written for.

A stream's manifest also carries the ``extract`` params its engines are built from (``extract``): the train stage
builds them from it, so the extract params that shape the states reach training through this one file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eaglenest.artifacts.hidden_states.format import TORCH_DTYPES, extraction_fingerprint
from eaglenest.core.errors import InputFileError
from eaglenest.core.json_file import read_json

if TYPE_CHECKING:
    from eaglenest.artifacts.verifier import VerifierInfo

MANIFEST_FILE = "manifest.json"


def rows_digest(input_ids: list[list[int]]) -> str:
    """sha256 of every prepared row's token ids, in order."""
    digest = hashlib.sha256()
    for ids in input_ids:
        digest.update(json.dumps(ids).encode())
        digest.update(b"\n")
    return digest.hexdigest()


# The stores that keep no hidden states, only this manifest.
MANIFEST_STORES = ("online", "stream")


def online_manifest(
    verifier: VerifierInfo,
    dtype: str,
    input_ids: list[list[int]],
    store: str = "online",
    extract: dict[str, object] | None = None,
) -> dict[str, object]:
    """What ``data/hidden_states/manifest.json`` records for ``extract.store: online`` or ``stream`` (which adds
    ``extract``, the params its engines are built from)."""
    return {
        "store": store,
        "rows": len(input_ids),
        "tokens": sum(len(ids) for ids in input_ids),
        "rows_sha256": rows_digest(input_ids),
        "verifier": verifier.fingerprint,
        "layer_ids": list(verifier.layer_ids),
        "hidden_size": verifier.hidden_size,
        "dtype": dtype,
        "config": extraction_fingerprint(verifier.fingerprint, verifier.layer_ids, dtype),
        **({"extract": extract} if extract is not None else {}),
    }


def read_online_manifest(hs_dir: Path, verifier: VerifierInfo, input_ids: list[list[int]]) -> dict[str, Any]:
    """The manifest of an online or stream extraction, checked against the prepared rows and the verifier.

    Raises:
        InputFileError: it is missing, unreadable, or written for other rows / another verifier or layer set
            (one line, with the fix).
    """
    path = Path(hs_dir) / MANIFEST_FILE
    manifest = read_json(
        path,
        f"{path}: missing, but extract.store keeps no hidden states (online or stream); run `dvc repro extract` "
        "(it writes the manifest)",
        "run `dvc repro extract`",
    )
    if (
        not isinstance(manifest, dict)
        or manifest.get("store") not in MANIFEST_STORES
        or manifest.get("dtype") not in TORCH_DTYPES
        or (manifest["store"] == "stream" and not isinstance(manifest.get("extract"), dict))
    ):
        raise InputFileError(f"{path}: not an eaglenest online or stream manifest; run `dvc repro extract`")
    expected = online_manifest(verifier, str(manifest["dtype"]), input_ids)
    stale = [
        key
        for key in ("rows", "rows_sha256", "verifier", "layer_ids", "hidden_size", "config")
        if manifest.get(key) != expected[key]
    ]
    if stale:
        raise InputFileError(
            f"{path}: its {', '.join(stale)} differ from the prepared rows and verifier now (an earlier "
            "extract wrote it); run `dvc repro extract`"
        )
    return manifest
