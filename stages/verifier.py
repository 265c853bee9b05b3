"""DVC stage `verifier`: resolve verifier.model and record N, hidden size, vocab and aux layers."""

import argparse
from pathlib import Path

from _guard import require_stage_environment

require_stage_environment("verifier")

from eaglenest.core.params import load_params  # noqa: E402
from eaglenest.core.stage import run_stage, stage_parser  # noqa: E402
from eaglenest.stages.verifier import build_verifier  # noqa: E402


def main(args: argparse.Namespace) -> None:
    build_verifier(load_params(args.params).verifier, Path(args.out))


def parser() -> argparse.ArgumentParser:
    return stage_parser(__doc__, {
        "out": "output folder (models/verifier)",
    })


if __name__ == "__main__":
    raise SystemExit(run_stage("verifier", main, parser()))
