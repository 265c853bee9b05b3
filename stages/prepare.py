"""DVC stage `prepare`: render conversations with the verifier's chat template into training rows."""

from _guard import require_stage_environment

require_stage_environment("prepare")

from eaglenest.core.stage import run_stage  # noqa: E402
from eaglenest.stages.prepare import STAGE  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(run_stage(STAGE))
