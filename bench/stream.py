"""Benchmark (run by hand): stored hidden states (extract, then train on the shards) against ``extract.store:
stream`` (train fed by a pool of engines) with 1 and 2 engine processes, on the demo's rows.

    .venv/bin/python bench/stream.py [--steps N] [--batch-tokens N] [--out bench/results/stream.json]

Needs the demo's outputs up to ``convert`` (models/verifier, data/prepared, data/vocab). Each mode runs in a process
of its own (so its peak memory is its own), with the params.yaml train section (``--steps`` overrides its steps; the
stream's batches are the stored run's, so all three train the same draft where the engines compute rows alike):

* ``stored``: the extract stage's code into a temporary folder (params.yaml's extract section), then training on it;
* ``stream-1``, ``stream-2``: the stream's manifest, then training with 1 or 2 engine processes beside the trainer.

Prints and writes, per mode: wall time (extraction included for stored), the trainer's share of time waiting for the
stream, engine rows/s, the bytes of hidden states on disk, the peak memory of the mode's processes together (its
resident set plus its children's, sampled every 0.2 s), and the sha256 of the draft's weights (equal where stored and
streamed rows are computed alike: ``--batch-tokens 0``, a forward per row).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MODES = ("stored", "stream-1", "stream-2")


def resident_bytes(pids: list[int]) -> int:
    """The resident set of ``pids`` together, from /proc."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def process_tree(pid: int) -> list[int]:
    """``pid`` and every live process below it."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [pid], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class PeakMemory:
    """Samples the resident set of this process and its children until stopped; keeps the largest."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, resident_bytes(process_tree(os.getpid())))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def run_mode(mode: str, steps: int | None, batch_tokens: int | None) -> dict[str, Any]:
    """One mode, in this process."""
    from eaglenest.commands.params_file import load_params
    from eaglenest.core.params import ClusterParams
    from eaglenest.stages.extract import extract_hidden_states
    from eaglenest.stages.train import TrainPaths, train_draft

    params = load_params()
    train = params.train if steps is None else params.train.model_copy(update={"steps": steps})
    store = "files" if mode == "stored" else "stream"
    extract = params.extract.model_copy(update={"store": store})
    if batch_tokens is not None:
        extract = extract.model_copy(update={"batch_tokens": batch_tokens})
    engines = 1 if mode == "stored" else int(mode.split("-")[1])
    memory = PeakMemory()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        hidden_states = Path(tmp) / "hs"
        extracted = extract_hidden_states(
            extract, Path("models/verifier"), Path("data/prepared"), hidden_states, Path(tmp) / "extract.json"
        )
        disk = folder_bytes(hidden_states)
        out = Path(tmp) / "train"
        metrics = train_draft(
            train,
            TrainPaths(
                verifier=Path("models/verifier"),
                prepared=Path("data/prepared"),
                hidden_states=hidden_states,
                vocab=Path("data/vocab"),
                out=out / "draft",
                metrics=out / "train.json",
                details=out / "details.json",
                live_dir=out / "live",
                checkpoints=out / "ck",
            ),
            ClusterParams(workers=engines),
        )
        wall = time.perf_counter() - started
        weights = hashlib.sha256((out / "draft" / "model.safetensors").read_bytes()).hexdigest()
    stream = metrics.get("stream", {})
    return {
        "mode": mode,
        "steps": train.steps,
        "batch_tokens": extract.batch_tokens,
        "wall_s": round(wall, 1),
        "extract_s": extracted["seconds"],
        "train_s": metrics["seconds"],
        "train_tokens_per_s": metrics["tokens_per_s"],
        "wait_share": stream.get("wait_share"),
        "engine_rows_per_s": stream.get("engine_rows_per_s"),
        "rows_streamed": stream.get("rows"),
        "hidden_state_bytes": disk,
        "peak_memory_bytes": memory.stop(),
        "val_loss": metrics["val_loss"],
        "tau_sim": metrics["tau_sim"],
        "mean_buffer_fill": stream.get("mean_buffer_fill"),
        "draft_sha256": weights,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="train.steps (default: params.yaml's)")
    parser.add_argument("--batch-tokens", type=int, default=None, help="extract.batch_tokens (default: params.yaml's)")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--mode", choices=MODES, default=None, help=argparse.SUPPRESS)  # one mode, in a child
    args = parser.parse_args()
    if args.mode is not None:
        print(json.dumps(run_mode(args.mode, args.steps, args.batch_tokens)))
        return
    results = []
    for mode in MODES:
        command = [sys.executable, __file__, "--mode", mode]
        if args.steps is not None:
            command += ["--steps", str(args.steps)]
        if args.batch_tokens is not None:
            command += ["--batch-tokens", str(args.batch_tokens)]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
