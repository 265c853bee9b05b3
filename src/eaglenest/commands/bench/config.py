"""The flags of ``eaglenest bench`` as typed settings, and their checks before anything is read or started."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eaglenest.artifacts.serve_schedule import SCHEDULE_FILE
from eaglenest.core.errors import EaglenestError

DEFAULT_CONCURRENCY = [1, 4, 16]


# Paired runs of both servers at every concurrency: the fewest whose spread gives an interval worth reading
# (Student's t at 2 degrees of freedom is 4.3; at 1 it is 12.7), at three times one round's runs.
DEFAULT_ROUNDS = 3


DEFAULT_OUT = Path("bench/results/serve")


DEFAULT_PORT = 8000


# Loading a verifier on a few CPU cores takes minutes; a server silent for this long is stuck.
DEFAULT_SERVER_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class ServeSetup:
    """How ``--serve`` starts the servers (``eaglenest serve``'s flags, and vLLM's after ``--``).

    Attributes:
        execution: The servers' models compiled or eager (``eaglenest serve --execution``).
        schedule: The K-per-batch-size record: the draft server is served with it where it is of this draft at the
            K served (the figures then check it); else the draft is served at one K at every batch size and the
            schedule read from the figures is written there.
        measure_schedule: Serve the draft at one K at every batch size whatever the record holds, and rewrite it.
    """

    baseline: str = "none"
    port: int = DEFAULT_PORT
    verifier: Path = Path("models/verifier")
    draft: Path = Path("models/draft")
    dtype: str = "auto"
    execution: str = "auto"
    num_speculative_tokens: int | None = None
    timeout_s: float = DEFAULT_SERVER_TIMEOUT_S
    vllm_args: tuple[str, ...] = ()
    schedule: Path = SCHEDULE_FILE
    measure_schedule: bool = False


@dataclass(frozen=True)
class BenchConfig:
    """What ``eaglenest bench`` was asked (its flags).

    Attributes:
        url: ``--url``, the draft server; None with ``serve``.
        baseline_url: ``--baseline-url``; None with ``serve``.
        tokenizer: ``--tokenizer``; None: ``serve.verifier``, else ``models/verifier``.
        tie_margin: ``--tie-margin``; None: ``evaluate.bf16_tie_margin``'s default.
        serve: ``--serve``: the servers to start here, one after the other; None: the two URLs.
        rounds: ``--rounds``: paired runs of both servers at every concurrency, for the speed-up's interval.
    """

    url: str | None
    baseline_url: str | None
    prompts: Path
    model: str | None = None
    tokenizer: Path | None = None
    concurrency: tuple[int, ...] = tuple(DEFAULT_CONCURRENCY)
    num_prompts: int | None = None
    max_tokens: int = 64
    temperature: float = 0.0
    warmup_prompts: int = 2
    timeout_s: float = 600.0
    out: Path = DEFAULT_OUT
    tie_margin: float | None = None
    serve: ServeSetup | None = None
    rounds: int = DEFAULT_ROUNDS

    @property
    def tokenizer_dir(self) -> Path:
        return self.tokenizer or (self.serve.verifier if self.serve is not None else Path("models/verifier"))


def check_config(config: BenchConfig) -> None:
    """Refuses flag values that cannot make a sweep, before anything is read or started."""
    urls = [flag for flag, value in (("--url", config.url), ("--baseline-url", config.baseline_url)) if value]
    if config.serve is not None and urls:
        raise EaglenestError(
            f"--serve with {' and '.join(urls)}: --serve starts both servers here, one after the "
            f"other; drop {' and '.join(urls)}, or drop --serve to benchmark servers already running"
        )
    if config.serve is None and len(urls) < 2:
        missing = " and ".join(f for f in ("--url", "--baseline-url") if f not in urls)
        raise EaglenestError(
            f"{missing} missing: give the draft server's --url and the baseline's --baseline-url, "
            "or --serve to start both here, one after the other"
        )
    if not config.concurrency or min(config.concurrency) < 1:
        raise EaglenestError(f"--concurrency {' '.join(map(str, config.concurrency))}: every value must be at least 1")
    for flag, value in (("--num-prompts", config.num_prompts), ("--max-tokens", config.max_tokens)):
        if value is not None and value < 1:
            raise EaglenestError(f"{flag} {value}: must be at least 1")
    if config.num_prompts is not None and config.num_prompts < max(config.concurrency):
        raise EaglenestError(
            f"--num-prompts {config.num_prompts}: below --concurrency {max(config.concurrency)}, "
            "so that many requests are never in flight; raise --num-prompts (several times the "
            "highest concurrency is best)"
        )
    if config.rounds < 1:
        raise EaglenestError(
            f"--rounds {config.rounds}: must be at least 1 (2 or more give the speed-up an "
            "interval at every concurrency)"
        )
    if config.warmup_prompts < 0:
        raise EaglenestError(f"--warmup-prompts {config.warmup_prompts}: must be 0 (no warm-up) or more")
    if config.temperature < 0:
        raise EaglenestError(f"--temperature {config.temperature}: must be 0 (greedy) or more")
    if config.timeout_s <= 0:
        raise EaglenestError(f"--timeout {config.timeout_s:g}: must be positive (seconds per run)")
    if config.tie_margin is not None and config.tie_margin < 0:
        raise EaglenestError(f"--tie-margin {config.tie_margin:g}: must be 0 (identical outputs only) or more")
    if config.serve is not None:
        if config.serve.baseline not in ("none", "ngram"):
            raise EaglenestError(f"--baseline {config.serve.baseline}: expected none or ngram")
        if not 0 < config.serve.port < 65536:
            raise EaglenestError(f"--port {config.serve.port}: expected a port, 1 to 65535")
        if config.serve.timeout_s <= 0:
            raise EaglenestError(
                f"--server-timeout {config.serve.timeout_s:g}: must be positive (seconds a server may take to answer)"
            )


def default_tie_margin() -> float:
    """``evaluate.bf16_tie_margin``'s default: ``--tie-margin`` when not given."""
    from eaglenest.artifacts.eval_params import EvaluateParams

    return float(EvaluateParams.model_fields["bf16_tie_margin"].default)
