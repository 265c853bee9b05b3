"""DVC stage `extract`: the verifier's hidden states for every prepared row (resumable)."""

import argparse
from pathlib import Path

from _guard import require_stage_environment

require_stage_environment("extract")

from eaglenest.extract import extract_hidden_states  # noqa: E402
from eaglenest.params import load_params  # noqa: E402
from eaglenest.stage import run_stage  # noqa: E402


def main(args: argparse.Namespace) -> None:
    params = load_params(args.params).extract
    extract_hidden_states(params, Path(args.verifier), Path(args.prepared), Path(args.out), Path(args.metrics))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--params", default="params.yaml", help="params file")
    p.add_argument("--verifier", required=True, help="the verifier stage's output folder")
    p.add_argument("--prepared", required=True, help="the prepare stage's dataset folder")
    p.add_argument("--out", required=True, help="hidden-state folder (data/hidden_states)")
    p.add_argument("--metrics", required=True, help="metrics JSON (metrics/extract.json)")
    return p


if __name__ == "__main__":
    raise SystemExit(run_stage("extract", main, parser()))
