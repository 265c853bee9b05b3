"""DVC stage `verifier`: resolve verifier.model and record N, hidden size, vocab and aux layers."""

from _guard import require_stage_environment

require_stage_environment("verifier")

from eaglenest.core.stage import run_stage  # noqa: E402
from eaglenest.stages.verifier import STAGE  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(run_stage(STAGE))
