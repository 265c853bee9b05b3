"""DVC stage `evaluate`: the draft in real speculative decoding — tau, lossless check, speed-up, n-gram baseline."""

import argparse
from pathlib import Path

from _guard import require_stage_environment

require_stage_environment("evaluate")

from eaglenest.core.params import load_params  # noqa: E402
from eaglenest.core.stage import run_stage, stage_parser  # noqa: E402
from eaglenest.stages.evaluate import evaluate  # noqa: E402


def main(args: argparse.Namespace) -> None:
    params = load_params(args.params).evaluate
    evaluate(params, Path(args.verifier), Path(args.prepared), Path(args.draft), Path(args.metrics), Path(args.plots))


def parser() -> argparse.ArgumentParser:
    return stage_parser(__doc__, {
        "verifier": "the verifier stage's output folder",
        "prepared": "the prepare stage's dataset folder (its held-out prompts)",
        "draft": "the train stage's draft checkpoint",
        "metrics": "metrics JSON (metrics/eval.json)",
        "plots": "folder for the plot tables (metrics/eval_plots)",
    })


if __name__ == "__main__":
    raise SystemExit(run_stage("evaluate", main, parser()))
