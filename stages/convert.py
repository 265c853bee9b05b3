"""DVC stage `convert`: validate every hidden-state file and build the draft vocabulary."""

import argparse
from pathlib import Path

from _guard import require_stage_environment

require_stage_environment("convert")

from eaglenest.core.params import load_params  # noqa: E402
from eaglenest.core.stage import run_stage, stage_parser  # noqa: E402
from eaglenest.stages.convert import convert  # noqa: E402


def main(args: argparse.Namespace) -> None:
    params = load_params(args.params)
    convert(params.convert, params.extract.dtype, Path(args.verifier), Path(args.prepared), Path(args.hidden_states),
            Path(args.out), Path(args.metrics), store=params.extract.store)


def parser() -> argparse.ArgumentParser:
    return stage_parser(__doc__, {
        "verifier": "the verifier stage's output folder",
        "prepared": "the prepare stage's dataset folder",
        "hidden-states": "the extract stage's folder",
        "out": "vocabulary folder (data/vocab)",
        "metrics": "metrics JSON (metrics/data.json)",
    })


if __name__ == "__main__":
    raise SystemExit(run_stage("convert", main, parser()))
