"""DVC stage `plan`: what to serve for the trained draft, from evaluate's timed turns (metrics/serving_plan.json)."""

from _guard import require_stage_environment

require_stage_environment("plan")

from eaglenest.core.stage import run_stage  # noqa: E402
from eaglenest.stages.plan import STAGE  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(run_stage(STAGE))
