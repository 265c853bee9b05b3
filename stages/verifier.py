"""DVC stage `verifier`: resolve verifier.model and record N, hidden size, vocab and aux layers."""

import argparse
from pathlib import Path

from _guard import require_stage_environment

require_stage_environment("verifier")

from eaglenest.params import load_params  # noqa: E402
from eaglenest.stage import run_stage  # noqa: E402
from eaglenest.verifier import build_verifier  # noqa: E402


def main(args: argparse.Namespace) -> None:
    build_verifier(load_params(args.params).verifier, Path(args.out))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--params", default="params.yaml", help="params file")
    p.add_argument("--out", required=True, help="output folder (models/verifier)")
    return p


if __name__ == "__main__":
    raise SystemExit(run_stage("verifier", main, parser()))
