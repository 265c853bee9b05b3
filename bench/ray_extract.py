"""Benchmark (run by hand): extraction on a Ray cluster of this machine against the local executor, and the driver's
own rate.

    .venv/bin/python bench/ray_extract.py [--rows 800] [--rows-per-shard 25] [--workdir /tmp/ray-extract-bench]

1. The built-in verifier (SmolLM2-135M) and a synthetic prepared set of the demo's size: ``--rows`` rows whose
   lengths are drawn (seeded) around the demo's mean of 121.8 tokens (97,458 tokens over 800 rows, at
   ``prepare.max_len`` 512), of random token ids: a forward costs the same whatever the tokens.
2. ``extract`` with ``cluster.executor: local`` and then ``ray`` (``address: local``: a cluster started for the
   stage, one engine per CPU), shards of ``--rows-per-shard`` rows, timed; the two folders compared byte for byte.
   From the executor's log: Ray's start (until the pool is planned) and the engines' start (until the last is up).
   CPU seconds of this process and of the processes it started and reaped (a local Ray cluster's servers, and
   through them its workers): what the work cost whatever else the machine runs.
3. The driver alone: ``--empty-tasks`` tasks that return nothing, then ``--big-tasks`` tasks that each return
   ``--big-mb`` MB which the driver writes to disk (shards coming back through Ray), on 2 actors.

Prints one JSON document and writes it to ``--out`` (default: bench/results/ray_extract.json).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import random
import resource
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from eaglenest.artifacts.hidden_states.extract_params import ExtractParams  # noqa: E402
from eaglenest.artifacts.prepared import write_prepared  # noqa: E402
from eaglenest.core.atomic import atomic_write_bytes  # noqa: E402
from eaglenest.core.executor import EngineNeeds, open_executor  # noqa: E402
from eaglenest.core.params import ClusterParams  # noqa: E402
from eaglenest.stages.extract import extract_hidden_states  # noqa: E402
from eaglenest.stages.verifier import build_verifier  # noqa: E402
from eaglenest.stages.verifier.params import VerifierParams  # noqa: E402

DEMO_MEAN_TOKENS = 97_458 / 800


class Timeline(logging.Handler):
    """When the executor's milestones were logged."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.planned: float | None = None
        self.ready: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if " engines (" in message and self.planned is None:
            self.planned = time.time()
        elif "ready (node" in message:
            self.ready.append(time.time())


def synthetic_rows(count: int, seed: int = 0) -> list[list[int]]:
    """``count`` rows of the demo's mean length (lognormal lengths, 16 to 512 tokens), random ids of SmolLM2's."""
    rng = random.Random(seed)
    lengths = [min(512, max(16, int(rng.lognormvariate(0, 0.45) * DEMO_MEAN_TOKENS * 0.905))) for _ in range(count)]
    return [[rng.randrange(100, 49152) for _ in range(length)] for length in lengths]


def cpu_seconds() -> float:
    """User and system CPU seconds of this process and of its reaped children."""
    return sum(
        usage.ru_utime + usage.ru_stime
        for usage in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
    )


def folder_digest(path: Path) -> str:
    digest = hashlib.md5()
    for file in sorted(path.iterdir()):
        digest.update(file.name.encode())
        digest.update(hashlib.md5(file.read_bytes()).digest())
    return digest.hexdigest()


@dataclass(frozen=True)
class EmptyTask:
    number: int
    mb: int = 0

    @property
    def label(self) -> str:
        return f"task {self.number}"


def no_engine() -> None:
    return None


def returns(engine: None, task: EmptyTask) -> np.ndarray:
    return np.zeros(task.mb * 1024 * 1024, dtype=np.uint8)


def driver_rate(tasks: int, mb: int, workers: int, scratch: Path) -> dict[str, Any]:
    """Tasks per second the dispatcher and the driver's writes sustain (the engines do nothing), from the first
    result to the last (the actors' start is not counted)."""
    arrived, written = [], []

    def on_result(task: EmptyTask, data: np.ndarray) -> None:
        if mb:
            atomic_write_bytes(scratch / f"{task.number}.bin", data, fsync=False)
            written.append(data.size)
        arrived.append(time.perf_counter())

    with open_executor(ClusterParams(executor="ray", workers=workers), EngineNeeds(None)) as executor:
        executor.run(no_engine, returns, [EmptyTask(i, mb) for i in range(tasks)], on_result)
    seconds = arrived[-1] - arrived[0]
    return {
        "tasks": tasks,
        "mb_each": mb,
        "seconds": round(seconds, 2),
        "tasks_per_s": round((tasks - 1) / seconds, 1),
        "mb_per_s": round(sum(written[1:]) / 2**20 / seconds, 1) if mb else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=800)
    parser.add_argument("--rows-per-shard", type=int, default=25)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "ray-extract-bench")
    parser.add_argument("--empty-tasks", type=int, default=2000)
    parser.add_argument("--big-tasks", type=int, default=16)
    parser.add_argument("--big-mb", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("bench/results/ray_extract.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    timeline = Timeline()
    logging.getLogger("eaglenest.core.executor").addHandler(timeline)
    logging.getLogger("eaglenest.core.executor").setLevel(logging.INFO)

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "verifier" / "verifier.json").is_file():
        build_verifier(VerifierParams(), work / "verifier")
    rows = synthetic_rows(args.rows)
    write_prepared(work / "prepared", rows, [[1] * len(r) for r in rows], len(rows) - 40, [])
    params = ExtractParams(rows_per_shard=args.rows_per_shard)
    runs = {}
    for name, cluster in (("local", ClusterParams()), ("ray", ClusterParams(executor="ray"))):
        out = work / f"hs-{name}"
        shutil.rmtree(out, ignore_errors=True)
        started, cpu = time.time(), cpu_seconds()
        metrics = extract_hidden_states(
            params, work / "verifier", work / "prepared", out, work / f"{name}.json", cluster
        )
        time.sleep(2)  # the local cluster's servers exit and are reaped
        runs[name] = {
            "seconds": round(time.time() - started - 2, 1),
            "cpu_seconds": round(cpu_seconds() - cpu, 1),
            "engines": metrics["engines"],
            "tokens_per_s": metrics["tokens_per_s"],
            "md5": folder_digest(out),
        }
        if name == "ray":
            runs[name]["ray_start_s"] = round(timeline.planned - started, 1)
            runs[name]["engines_up_s"] = round(max(timeline.ready) - started, 1)
            runs[name]["after_last_engine_up_s"] = round(time.time() - max(timeline.ready), 1)
    result = {
        "host": {
            "cpu": platform.processor() or platform.machine(),
            "cpus": len(os.sched_getaffinity(0)),
            "load_avg_at_end": os.getloadavg(),
        },
        "rows": args.rows,
        "tokens": sum(len(r) for r in rows),
        "rows_per_shard": args.rows_per_shard,
        "shards": -(-args.rows // args.rows_per_shard),
        "runs": runs,
        "same_bytes": runs["local"]["md5"] == runs["ray"]["md5"],
        "driver_empty": driver_rate(args.empty_tasks, 0, 2, work),
        "driver_big": driver_rate(args.big_tasks, args.big_mb, 2, work / "big"),
    }
    shutil.rmtree(work / "big", ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
