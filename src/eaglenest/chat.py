"""Chat helpers every stage that generates shares: which tokens end an assistant turn, and cutting there.

The prepare stage renders conversations and regenerates replies, the evaluate stage decodes them; all of
them must agree on where a reply ends, so the rule lives here, below every stage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def end_of_turn_ids(tokenizer: Any, model_dir: Path | None = None) -> set[int]:
    """Token ids that end an assistant turn: the tokenizer's EOS and generation_config's eos ids."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen_config = model_dir / "generation_config.json" if model_dir else None
    if gen_config is not None and gen_config.is_file():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


def cut_after_end_of_turn(tokens: list[int], eot_ids: set[int]) -> list[int]:
    """The tokens up to and including the first end-of-turn token (generation pads or runs on after it)."""
    for i, token in enumerate(tokens):
        if token in eot_ids:
            return tokens[: i + 1]
    return tokens
