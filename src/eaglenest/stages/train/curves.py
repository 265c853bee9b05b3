"""The training curves: dvclive's logger on the main process, and every value it logged, which checkpoints keep.

A resumed run (a rerun after a kill, or a restart by torchrun's launcher) starts a fresh dvclive folder and logs
the values its checkpoint kept, in their order, before it goes on; so dvclive/train needs no ``persist`` in
dvc.yaml (DVC refuses its run-cache to a stage with a persist output), and a resumed run's curves are an
uninterrupted run's. Only ``train/tokens_per_s``, a measured speed, differs between two runs.
"""

from __future__ import annotations

import shutil
from pathlib import Path

# (step, metric name, value), in the order logged.
Logged = list[tuple[int, str, float]]


class Curves:
    """dvclive's ``Live`` in ``live_dir``, started afresh with ``logged`` written again.

    dvclive step s holds what was measured after s optimizer steps (step 0: the untrained draft).
    """

    def __init__(self, live_dir: Path, logged: Logged) -> None:
        from dvclive import Live

        shutil.rmtree(live_dir, ignore_errors=True)  # a killed run's rows after its checkpoint go with it
        self.live = Live(dir=str(live_dir), dvcyaml=False, save_dvc_exp=False, resume=False, report=None)
        self.logged: Logged = []
        for step, name, value in logged:
            self.log(step, name, value)

    def log(self, step: int, name: str, value: float) -> None:
        """Logs ``name`` = ``value`` at ``step``, and keeps it for the next checkpoint."""
        value = float(value)  # a replayed value is written as the first run wrote it
        self.live.step = step
        self.live.log_metric(name, value)
        self.logged.append((step, name, value))

    def end(self) -> None:
        """Writes dvclive's summary (metrics.json: each curve's last value)."""
        self.live.end()
