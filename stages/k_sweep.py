"""DVC stage `k_sweep`: the trained draft timed at each K, plain and draft interleaved: the K served for it."""

from _guard import require_stage_environment

require_stage_environment("k_sweep")

from eaglenest.core.stage import run_stage  # noqa: E402
from eaglenest.stages.k_sweep import STAGE  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(run_stage(STAGE))
