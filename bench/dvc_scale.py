"""Benchmark (run by hand): what DVC costs on the hidden-state output at training-set scale, as per-row files and
as shards (``extract.rows_per_shard``), and how fast training reads rows from each.

    .venv/bin/python bench/dvc_scale.py --rows 10000 100000 500000 --rows-per-shard 1 256 1024
    .venv/bin/python bench/dvc_scale.py --real-rows 2000 --rows-per-shard 1 256   # rows of the demo's size

For each row count and shard size, a scratch DVC repository gets ``data/hidden_states`` in the real format
(eaglenest's own writer and packer) and a pipeline of the default shape: ``extract`` (the folder as a persisted
output), ``convert`` and ``train`` (both depending on it). Small rows (``--row-tokens`` tokens of 4 slots x 8
values in bf16, a few hundred bytes) measure DVC's per-file cost; ``--real-rows`` rows of the demo verifier's size
(4 slots x 576 values x ``--real-tokens`` tokens, about 525 KB) measure its data rate. Timed, in this order:

* the first ``dvc repro`` (hashes the folder: what ``dvc add`` pays), then a no-op ``dvc repro`` and ``dvc status``;
* ``dvc push`` to a local-folder remote, then ``dvc pull`` into an empty cache and workspace, then ``dvc checkout``
  of the folder from the cache (``cache.type`` copy, DVC's default);
* rows read per second in a random order through the train stage's readers (speculators' FP8Transfer for row
  files, eaglenest's shard reader for shards).

``--remote s3`` pushes and pulls through a SeaweedFS S3 store on 127.0.0.1 instead (``eaglenest remote``'s own
start, one per run), the team remote's path; both give seconds and MB/s.

Prints a markdown table and writes ``--out`` (JSON). An object-store remote pays a request per file per push or
pull on top of the bytes: the projection column multiplies the file count by ``--round-trip-ms``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from eaglenest.artifacts.hidden_states.format import encode_hidden_states, file_metadata
from eaglenest.artifacts.hidden_states.layout import FileSink, FileWriter, file_layout, shard_plan
from eaglenest.commands.remote.dvc_config import configure_remote
from eaglenest.commands.remote.store import WeedStore, start_store, stop_store
from eaglenest.core.host import host_record

VENV_BIN = Path(sys.executable).parent
DVC_YAML = """stages:
  extract:
    cmd: python -c "pass"
    outs:
      - data/hidden_states:
          persist: true
  convert:
    cmd: python -c "open('vocab.txt', 'w').write('v')"
    deps:
      - data/hidden_states
    outs:
      - vocab.txt
  train:
    cmd: python -c "open('draft.txt', 'w').write('d')"
    deps:
      - data/hidden_states
      - vocab.txt
    outs:
      - draft.txt
"""


def write_rows(folder: Path, rows: int, tokens: int, hidden: int, rows_per_shard: int) -> None:
    """``rows`` rows of random bf16 hidden states [tokens, 4, hidden] in the stage's layout, written with the
    stage's own writer: shards of ``rows_per_shard`` rows (1: row files)."""
    folder.mkdir(parents=True)
    metadata = file_metadata("bench", [1, 2, 3, 4], "bfloat16", "hf")
    generator = torch.Generator().manual_seed(0)
    for spec in shard_plan(rows, rows_per_shard):
        token_ids = [torch.randint(0, 49152, (tokens,), generator=generator).tolist() for _ in spec.rows]
        layout = file_layout(spec, token_ids, 4, hidden, "bfloat16", metadata)
        writer = FileWriter(layout, FileSink(layout, spec.path(folder)))
        for row in spec.rows:
            writer.write_row(row, encode_hidden_states(torch.randn(tokens, 4, hidden, generator=generator), "bfloat16"))
        writer.finish()


def timed(command: list[str], cwd: Path) -> float:
    started = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed in {cwd}:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return round(seconds, 2)


def read_rate(folder: Path, rows: int, sample: int) -> float:
    """Rows per second read in a random order by the train stage's reader for this layout."""
    from eaglenest.stages.train.data import stored_transfer

    transfer = stored_transfer(folder, rows, torch.float32)
    order = random.Random(0).sample(range(rows), min(sample, rows))
    started = time.perf_counter()
    for row in order:
        transfer.get_cached(row)["hidden_states"].float().sum()
    return round(len(order) / (time.perf_counter() - started), 1)


def measure(
    rows: int,
    rows_per_shard: int,
    tokens: int,
    hidden: int,
    scratch: Path,
    read_sample: int,
    store: WeedStore | None = None,
) -> dict:
    """One case; ``store``: push and pull through that S3 store, else through a local folder."""
    repo = scratch / f"repo-{rows}-{rows_per_shard}-{hidden}"
    remote = scratch / f"remote-{rows}-{rows_per_shard}-{hidden}"
    repo.mkdir()
    dvc = str(VENV_BIN / "dvc")
    env_site = {"DVC_SITE_CACHE_DIR": str(scratch / "site-cache")}
    os.environ.update(env_site)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run([dvc, "init", "-q"], cwd=repo, check=True)
    subprocess.run([dvc, "config", "core.analytics", "false"], cwd=repo, check=True)
    if store is None:
        subprocess.run([dvc, "remote", "add", "-d", "local", str(remote)], cwd=repo, check=True, capture_output=True)
    else:
        configure_remote(repo, store, prefix=remote.name)
    (repo / "dvc.yaml").write_text(DVC_YAML)
    started = time.perf_counter()
    write_rows(repo / "data" / "hidden_states", rows, tokens, hidden, rows_per_shard)
    written = round(time.perf_counter() - started, 1)
    folder = repo / "data" / "hidden_states"
    files = sum(1 for _ in folder.iterdir())
    size = sum(p.stat().st_size for p in folder.iterdir())
    result = {
        "rows": rows,
        "rows_per_shard": rows_per_shard,
        "files": files,
        "bytes": size,
        "row_bytes": round(size / rows),
        "write_s": written,
    }
    result["first_repro_s"] = timed([dvc, "repro", "-q"], repo)
    result["noop_repro_s"] = timed([dvc, "repro", "-q"], repo)
    result["noop_status_s"] = timed([dvc, "status", "-q"], repo)
    result["push_s"] = timed([dvc, "push", "-q"], repo)
    result["push_mb_per_s"] = round(size / 1e6 / result["push_s"], 1)
    shutil.rmtree(repo / ".dvc" / "cache")
    shutil.rmtree(folder)
    result["pull_s"] = timed([dvc, "pull", "-q"], repo)
    result["pull_mb_per_s"] = round(size / 1e6 / result["pull_s"], 1)
    shutil.rmtree(folder)
    result["checkout_s"] = timed([dvc, "checkout", "-q", "data/hidden_states"], repo)
    result["read_rows_per_s"] = read_rate(folder, rows, read_sample)
    shutil.rmtree(repo)
    shutil.rmtree(remote, ignore_errors=True)  # an S3 run's objects stay in the store, deleted with the scratch
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--rows",
        type=int,
        nargs="*",
        default=[10_000, 100_000, 500_000],
        help="row counts of small rows (per-file cost)",
    )
    parser.add_argument("--row-tokens", type=int, default=8, help="tokens per small row")
    parser.add_argument("--real-rows", type=int, default=0, help="rows of the demo's size (data rate); 0: none")
    parser.add_argument("--real-tokens", type=int, default=114, help="tokens per real-size row (the demo's mean)")
    parser.add_argument("--rows-per-shard", type=int, nargs="+", default=[1, 256, 1024])
    parser.add_argument("--read-sample", type=int, default=2000, help="rows read for the read rate")
    parser.add_argument(
        "--round-trip-ms", type=float, default=20.0, help="an object store's per-request latency, for the projection"
    )
    parser.add_argument("--scratch", type=Path, default=None, help="where the repositories go (default: a temp dir)")
    parser.add_argument(
        "--remote",
        choices=["local", "s3"],
        default="local",
        help="push and pull through a local folder or a SeaweedFS S3 store on 127.0.0.1",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/dvc_scale.json"))
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="dvc-scale-", dir=args.scratch))
    store = start_store(scratch / "store") if args.remote == "s3" else None
    cases = [(rows, args.row_tokens, 8) for rows in args.rows]
    if args.real_rows:
        cases.append((args.real_rows, args.real_tokens, 576))
    results = []
    print(f"remote: {args.remote}")
    print(
        "| rows | rows/shard | files | MB | first repro s | no-op repro s | no-op status s | push s (MB/s) | "
        "pull s (MB/s) | checkout s | rows/s read | object store: requests x RTT s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for rows, tokens, hidden in cases:
        for rows_per_shard in args.rows_per_shard:
            result = measure(rows, rows_per_shard, tokens, hidden, scratch, args.read_sample, store)
            result |= {
                "row_tokens": tokens,
                "hidden": hidden,
                "remote": args.remote,
                "object_store_request_s": round(result["files"] * args.round_trip_ms / 1000, 1),
            }
            results.append(result)
            print(
                f"| {rows:,} | {rows_per_shard} | {result['files']:,} | {result['bytes'] / 1e6:,.1f} | "
                f"{result['first_repro_s']} | {result['noop_repro_s']} | {result['noop_status_s']} | "
                f"{result['push_s']} ({result['push_mb_per_s']}) | {result['pull_s']} ({result['pull_mb_per_s']}) | "
                f"{result['checkout_s']} | {result['read_rows_per_s']} | "
                f"{result['object_store_request_s']} |",
                flush=True,
            )
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(
                json.dumps({"round_trip_ms": args.round_trip_ms, "host": host_record(), "results": results}, indent=2)
                + "\n"
            )
    if store is not None:
        stop_store(scratch / "store")
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
