"""DVC stage `prepare`: render conversations with the verifier's chat template into training rows."""

import argparse
from pathlib import Path

from _guard import require_stage_environment

require_stage_environment("prepare")

from eaglenest.artifacts.verifier import load_tokenizer, load_verifier_info  # noqa: E402
from eaglenest.core.chat import end_of_turn_ids  # noqa: E402
from eaglenest.core.params import load_params  # noqa: E402
from eaglenest.core.stage import run_stage, stage_parser  # noqa: E402
from eaglenest.stages.prepare import prepare_dataset  # noqa: E402
from eaglenest.stages.prepare.regenerate import verifier_generator  # noqa: E402
from eaglenest.stages.prepare.self_instruct import self_instruct_writer  # noqa: E402


def main(args: argparse.Namespace) -> None:
    params = load_params(args.params).prepare  # validated before the tokenizer loads
    info, model_dir = load_verifier_info(Path(args.verifier))
    tokenizer = load_tokenizer(Path(args.verifier))
    eot = end_of_turn_ids(tokenizer, model_dir)
    generator = verifier_generator(params, info, model_dir, tokenizer, eot) if params.regenerate else None
    prepare_dataset(params, tokenizer, Path(args.out), Path(args.metrics), eot,
                    regenerator=generator.regenerate if generator else None,
                    prompt_writer=self_instruct_writer(params, info, generator, tokenizer, eot) if generator else None)


def parser() -> argparse.ArgumentParser:
    return stage_parser(__doc__, {
        "verifier": "the verifier stage's output folder",
        "out": "output dataset folder (data/prepared)",
        "metrics": "metrics JSON (metrics/prepare.json)",
    })


if __name__ == "__main__":
    raise SystemExit(run_stage("prepare", main, parser()))
