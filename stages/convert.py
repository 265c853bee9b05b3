"""DVC stage `convert`: validate every hidden-state file and build the draft vocabulary."""

from _guard import require_stage_environment

require_stage_environment("convert")

from eaglenest.core.stage import run_stage  # noqa: E402
from eaglenest.stages.convert import STAGE  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(run_stage(STAGE))
