"""DVC stage `free_sweep`: vLLM's n-gram drafting at the window and K measured fastest: evaluate's baseline."""

from _guard import require_stage_environment

require_stage_environment("free_sweep")

from eaglenest.core.stage import run_stage  # noqa: E402
from eaglenest.stages.free_sweep import STAGE  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(run_stage(STAGE))
