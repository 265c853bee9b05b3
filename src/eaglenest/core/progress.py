"""Progress of every long step, with its rate and ETA: tqdm's bar on a terminal, timestamped lines in a log.

A bar redrawn with carriage returns turns a Slurm log or a ``tee`` file into one enormous line. When standard
error is not a terminal, the same tqdm meter (count, elapsed, ETA, rate, postfix) is logged as one line per
``LOG_INTERVAL`` seconds instead, through ``logging``, so it carries the stage's prefix and timestamp.
"""

from __future__ import annotations

import logging
import re
import sys
from typing import Any

from tqdm import tqdm

log = logging.getLogger("eaglenest.progress")

# Seconds between two lines of one meter in a log (a terminal's bar redraws as tqdm likes).
LOG_INTERVAL = 30.0
# Cursor moves tqdm writes around a nested meter (vLLM's per-request one inside ours): nothing for a log.
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class _LogLines:
    """The file tqdm draws on when there is no terminal: each redraw becomes one log line."""

    def __init__(self) -> None:
        self.last_count = ""

    def write(self, text: str) -> None:
        line = ANSI_ESCAPE.sub("", text).replace("\r", "").strip()
        count = line.partition(" [")[0]  # "desc: 40%|####      | 4/10": the rate and ETA follow it
        if line and count != self.last_count:  # closing redraws the last count (a refresh may have drawn it)
            self.last_count = count
            log.info("%s", line)

    def flush(self) -> None:
        pass


def progress(total: float | None, desc: str, unit: str = "it", **kwargs: Any) -> tqdm:
    """A tqdm meter over ``total`` units of work named ``desc``.

    Args:
        total: The units of work (None when unknown: no ETA).
        desc: What is being done, the meter's first words.
        unit: What one unit is ("row", "conv", "step", "B" with ``unit_scale=True``).
        **kwargs: More of tqdm's arguments (``initial``, ``unit_scale``, ``postfix``...).
    """
    if sys.stderr.isatty():
        return tqdm(total=total, desc=desc, unit=unit, **kwargs)
    kwargs.pop("dynamic_ncols", None)  # vLLM asks for it; a log has no width to follow
    return tqdm(
        total=total, desc=desc, unit=unit, file=_LogLines(), mininterval=LOG_INTERVAL, ncols=100, ascii=True, **kwargs
    )


def vllm_progress(desc: str, unit: str) -> Any:
    """What vLLM's ``generate(use_tqdm=...)`` takes for a meter of ours: per request, with its token rates."""

    def make(total: int, **vllm_kwargs: Any) -> tqdm:
        vllm_kwargs.pop("desc", None)  # "Processed prompts": ours names the step
        return progress(total, desc, unit, **vllm_kwargs)

    return make
