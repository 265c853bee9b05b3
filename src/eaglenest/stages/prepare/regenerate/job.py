"""The regeneration back ends' contract: what a back end is given (:class:`GeneratorJob`), what it returns
(a :class:`ReplyGenerator`) and how it names its output for the caches (:class:`ReplyBackend`). Back ends
import this module, never the package that dispatches to them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from eaglenest.artifacts.verifier import VerifierInfo
from eaglenest.stages.prepare.params import PrepareParams


@dataclass(frozen=True)
class Sampling:
    """How to sample one batch, when it is not the regeneration params' (the prompts the verifier writes).

    Attributes:
        temperature: Sampling temperature (> 0).
        max_new_tokens: Longest completion.
    """

    temperature: float
    max_new_tokens: int


class ReplyGenerator(Protocol):
    """(prompts as token ids, seed) -> one completion per prompt, each ending at its first end-of-turn token
    if any. With ``sampling`` given, it replaces the regeneration params, and identical prompts in one batch
    give different completions (they draw from one random stream in turn); without it, the regeneration
    params apply."""

    def __call__(self, prompts: list[list[int]], seed: int, sampling: Sampling | None = None) -> list[list[int]]: ...


@dataclass(frozen=True)
class GeneratorJob:
    """Everything a regeneration back end needs to load the verifier.

    Attributes:
        params: The prepare params (``regenerate_*``, ``max_len``, ``seed``).
        info: The verifier stage's record.
        model_dir: The verifier's weights on this machine.
        tokenizer: The verifier's tokenizer.
        eos_ids: Token ids that end an assistant turn.
    """

    params: PrepareParams
    info: VerifierInfo
    model_dir: Path
    tokenizer: Any
    eos_ids: set[int]


@dataclass(frozen=True)
class ReplyBackend:
    """One regeneration back end.

    Attributes:
        dtype: The dtype it runs the verifier in, known without loading it: with the back end's name it keys
            every cache entry (``hf-float32``, ``vllm-bfloat16``), since a bf16 engine writes other replies.
        load: Loads the verifier and returns its :class:`ReplyGenerator`.
    """

    dtype: Callable[[GeneratorJob], str]
    load: Callable[[GeneratorJob], ReplyGenerator]
