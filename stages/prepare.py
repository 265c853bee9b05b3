"""DVC stage `prepare`: render conversations with the verifier's chat template into training rows."""

import argparse
from pathlib import Path

from _guard import require_stage_environment

require_stage_environment("prepare")

from eaglenest.params import load_params  # noqa: E402
from eaglenest.prepare import end_of_turn_ids, prepare_dataset  # noqa: E402
from eaglenest.regenerate import verifier_regenerator  # noqa: E402
from eaglenest.stage import run_stage, stage_parser  # noqa: E402
from eaglenest.verifier import load_tokenizer, load_verifier_info  # noqa: E402


def main(args: argparse.Namespace) -> None:
    params = load_params(args.params).prepare  # validated before the tokenizer loads
    info, model_dir = load_verifier_info(Path(args.verifier))
    tokenizer = load_tokenizer(Path(args.verifier))
    eot = end_of_turn_ids(tokenizer, model_dir)
    regenerator = verifier_regenerator(params, info, model_dir, tokenizer, eot) if params.regenerate else None
    prepare_dataset(params, tokenizer, Path(args.out), Path(args.metrics), eot, regenerator)


def parser() -> argparse.ArgumentParser:
    return stage_parser(__doc__, {
        "verifier": "the verifier stage's output folder",
        "out": "output dataset folder (data/prepared)",
        "metrics": "metrics JSON (metrics/prepare.json)",
    })


if __name__ == "__main__":
    raise SystemExit(run_stage("prepare", main, parser()))
