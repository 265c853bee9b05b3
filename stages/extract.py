"""DVC stage `extract`: the verifier's hidden states for every prepared row (resumable)."""

import argparse
from pathlib import Path

from _guard import require_stage_environment

require_stage_environment("extract")

from eaglenest.core.params import load_params  # noqa: E402
from eaglenest.core.stage import run_stage, stage_parser  # noqa: E402
from eaglenest.stages.extract import extract_hidden_states, shard_params  # noqa: E402


def main(args: argparse.Namespace) -> None:
    params = load_params(args.params).extract
    if args.rank is not None or args.world_size is not None:  # one shard of a multi-node run (README)
        params = shard_params(params, args.rank, args.world_size)
    extract_hidden_states(params, Path(args.verifier), Path(args.prepared), Path(args.out), Path(args.metrics))


def parser() -> argparse.ArgumentParser:
    parser = stage_parser(__doc__, {
        "verifier": "the verifier stage's output folder",
        "prepared": "the prepare stage's dataset folder",
        "out": "hidden-state folder (data/hidden_states)",
        "metrics": "metrics JSON (metrics/extract.json)",
    })
    parser.add_argument("--rank", type=int, help="this node's shard (overrides extract.rank)")
    parser.add_argument("--world-size", type=int, help="the number of shards (overrides extract.world_size)")
    return parser


if __name__ == "__main__":
    raise SystemExit(run_stage("extract", main, parser()))
