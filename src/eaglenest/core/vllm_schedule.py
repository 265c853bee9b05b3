"""vLLM's own reading of a K-per-batch-size schedule, and its default largest batch: what ``eaglenest serve`` asks the
installed vLLM before it starts a server with a schedule (``num_speculative_tokens_per_batch_size``).

Both import vLLM (a second or two), so they run only where a schedule is served; where this interpreter has no vLLM
they answer None and the caller keeps its own check (:func:`eaglenest.artifacts.serve_schedule.schedule_problem`).
"""

from __future__ import annotations

import importlib.util


def vllm_refusal(schedule: list[tuple[int, int, int]], max_num_seqs: int, k: int) -> str | None:
    """Why vLLM's scheduler would refuse ``schedule`` for a server of ``max_num_seqs`` at ``num_speculative_tokens``
    ``k``: its ``build_dynamic_sd_schedule_lookup`` (which validates with
    ``validate_and_normalize_dynamic_sd_schedule``) run on it; None where it accepts it or vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        return None
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    try:
        build_dynamic_sd_schedule_lookup([list(entry) for entry in schedule], max_num_seqs, k)
    except ValueError as err:
        return str(err)
    return None


def vllm_k_per_batch_size(schedule: list[tuple[int, int, int]], max_num_seqs: int, k: int) -> list[int]:
    """The K vLLM's scheduler takes at each batch size 1..``max_num_seqs`` under ``schedule`` (its dense lookup,
    index 0 dropped).

    Raises:
        ValueError: vLLM refuses the schedule.
        ModuleNotFoundError: no vLLM in this interpreter.
    """
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    return build_dynamic_sd_schedule_lookup([list(entry) for entry in schedule], max_num_seqs, k)[1:]


def default_max_num_seqs(world_size: int = 1) -> int | None:
    """``max_num_seqs`` of an OpenAI API server of the installed vLLM when no ``--max-num-seqs`` is given (it depends
    on the platform: 128 per rank on CPU, 256 to 1024 on GPUs), from vLLM's own table; None without vLLM."""
    if importlib.util.find_spec("vllm") is None:
        return None
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    return int(EngineArgs.get_batch_defaults(world_size)[1][UsageContext.OPENAI_API_SERVER])
