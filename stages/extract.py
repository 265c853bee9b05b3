"""DVC stage `extract`: the verifier's hidden states for every prepared row (resumable)."""

from _guard import require_stage_environment

require_stage_environment("extract")

from eaglenest.core.stage import run_stage  # noqa: E402
from eaglenest.stages.extract import STAGE  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(run_stage(STAGE))
