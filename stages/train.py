"""DVC stage `train`: the EAGLE-3 draft, trained with training-time test, logged with dvclive, resumable."""

import argparse
import os
import sys
from pathlib import Path

from _guard import require_stage_environment

require_stage_environment("train")

from eaglenest.core.errors import EaglenestError  # noqa: E402
from eaglenest.core.params import load_params  # noqa: E402
from eaglenest.core.stage import run_stage, stage_parser  # noqa: E402
from eaglenest.stages.train import TrainInputs, train_draft  # noqa: E402
from eaglenest.stages.train.distributed import relaunch_with_torchrun  # noqa: E402


def main(args: argparse.Namespace) -> None:
    params = load_params(args.params).train
    if params.nproc > 1 and "LOCAL_RANK" not in os.environ:  # not yet under torchrun: start it
        code = relaunch_with_torchrun(params.nproc, __file__, sys.argv[1:])
        if code != 0:
            raise EaglenestError(f"the {params.nproc} training processes failed (exit {code}); see their output above")
        return
    train_draft(params, TrainInputs(
        verifier=Path(args.verifier), prepared=Path(args.prepared), hidden_states=Path(args.hidden_states),
        vocab=Path(args.vocab), out=Path(args.out), metrics=Path(args.metrics), live_dir=Path(args.live),
    ))


def parser() -> argparse.ArgumentParser:
    return stage_parser(__doc__, {
        "verifier": "the verifier stage's output folder",
        "prepared": "the prepare stage's dataset folder",
        "hidden-states": "the extract stage's folder",
        "vocab": "the convert stage's vocabulary folder",
        "out": "the draft checkpoint folder (models/draft)",
        "metrics": "metrics JSON (metrics/train.json)",
        "live": "dvclive folder (dvclive/train)",
    })


if __name__ == "__main__":
    raise SystemExit(run_stage("train", main, parser()))
