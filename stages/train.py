"""DVC stage `train`: the EAGLE-3 draft, trained with training-time test, logged with dvclive, resumable."""

from _guard import require_stage_environment

require_stage_environment("train")

from eaglenest.core.stage import run_stage  # noqa: E402
from eaglenest.stages.train import STAGE  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(run_stage(STAGE))
