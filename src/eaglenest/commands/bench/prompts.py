"""The prompts file (``--prompts``), rendered to token ids with the verifier's chat template, as evaluate renders its
sets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglenest.commands.bench.config import BenchConfig
from eaglenest.core.errors import EaglenestError


def load_bench_tokenizer(directory: Path) -> tuple[Any, str | None]:
    """The tokenizer prompts are rendered with, and the served name its verifier record gives (else None).

    Args:
        directory: The verifier stage's folder (``verifier.json``), or any local tokenizer folder.
    """
    from eaglenest.artifacts.verifier import INFO_FILE, load_tokenizer, load_verifier_info

    if (directory / INFO_FILE).is_file():
        info, _ = load_verifier_info(directory)
        return load_tokenizer(directory), info.name
    if not directory.is_dir():
        raise EaglenestError(
            f"--tokenizer {directory}: not a folder; give the verifier stage's output "
            "(models/verifier) or the served model's folder"
        )
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as err:
        raise EaglenestError(
            f"--tokenizer {directory}: no tokenizer there ({type(err).__name__}); give the "
            "verifier stage's output (models/verifier) or the served model's folder"
        ) from None
    if not getattr(tokenizer, "chat_template", None):
        raise EaglenestError(
            f"--tokenizer {directory}: the tokenizer has no chat template; the prompts are "
            "rendered with the verifier's own, so give an instruct/chat model's folder"
        )
    return tokenizer, None


BUILTIN_PROMPTS = ("builtin:humaneval", "builtin:general", "builtin:long")


def bench_prompts_file(prompts: Path) -> Path:
    """The file ``--prompts`` names: a JSONL path, or one of evaluate's shipped sets by its ``source`` name."""
    from eaglenest.artifacts.eval_params import EvalSetParams
    from eaglenest.artifacts.eval_sets import source_file

    if str(prompts) in BUILTIN_PROMPTS:
        return source_file(EvalSetParams(name="bench", source=str(prompts)), Path("."))
    if str(prompts).startswith("builtin:"):
        raise EaglenestError(
            f"--prompts {prompts}: no such shipped set; choose {', '.join(BUILTIN_PROMPTS)} or give a JSONL file"
        )
    return prompts


def render_prompts(conversations: list[Any], source: Path, tokenizer: Any) -> list[list[int]]:
    """Token ids of each conversation's first turn in the verifier's chat template, as evaluate renders it."""
    from eaglenest.artifacts.eval_params import EvalSetParams
    from eaglenest.artifacts.eval_sets import EvalSet

    eval_set = EvalSet(EvalSetParams(name="bench", source=str(source)), conversations, {})
    return [[int(t) for t in eval_set.render(c, 0, [], tokenizer)] for c in conversations]


def check_length(served: dict[str, Any], prompts: list[list[int]], config: BenchConfig) -> None:
    """Refuses prompts that do not fit the server's context with ``--max-tokens``."""
    longest = max(len(p) for p in prompts) + config.max_tokens
    max_model_len = served.get("max_model_len")
    if isinstance(max_model_len, int) and longest > max_model_len:
        raise EaglenestError(
            f"--prompts {config.prompts}: the longest prompt plus --max-tokens is {longest} tokens, "
            f"past the server's max_model_len {max_model_len}; lower --max-tokens or drop long "
            "prompts"
        )
