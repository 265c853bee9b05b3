"""Records a served bench as the project's measurement of the draft under load: ``bench.json`` with the command
that ran it, the commit and this host's kind, written to ``bench/results/serve_concurrency.json``.

Run it on the machine that ran the bench, in the checkout it ran at, then ``eaglenest report --docs``:

    python scripts/record_serve_bench.py OUT/bench.json --command 'eaglenest bench --serve ...'
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eaglenest.commands.generated.concurrency import SERVE_RECORD, record_bench
from eaglenest.core.errors import InputFileError


def main(argv: list[str] | None = None) -> int:
    """``python scripts/record_serve_bench.py BENCH_JSON --command CMD [--repo DIR]``."""
    parser = argparse.ArgumentParser(prog="record_serve_bench.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("bench_json", help="the bench's result (OUT/bench.json of `eaglenest bench`)")
    parser.add_argument("--command", required=True, help="the command that ran the bench, as typed")
    parser.add_argument("--repo", default=".", help="the checkout it ran at (default: the current folder)")
    args = parser.parse_args(argv)
    repo = Path(args.repo)
    try:
        record = record_bench(Path(args.bench_json), args.command, repo, repo / SERVE_RECORD)
    except InputFileError as err:
        print(f"record_serve_bench.py: error: {err}", file=sys.stderr)
        return 2
    speedups = ", ".join(f"x{level.speedup:.2f} at {level.concurrency}" for level in record.levels)
    print(f"wrote {repo / SERVE_RECORD}: {speedups}, on {record.host}; now run `eaglenest report --docs`")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
