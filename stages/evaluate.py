"""DVC stage `evaluate`: the draft in real speculative decoding: tau, lossless check, speed-up, n-gram baseline."""

from _guard import require_stage_environment

require_stage_environment("evaluate")

from eaglenest.core.stage import run_stage  # noqa: E402
from eaglenest.stages.evaluate import STAGE  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(run_stage(STAGE))
