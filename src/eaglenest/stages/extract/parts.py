"""Multi-node extraction: which part wrote into a shared ``data/hidden_states``, and whether the parts tile it.

Each node of a multi-node extraction (``extract.world_size`` > 1) computes the contiguous rows
:func:`part_rows` gives its rank, into one shared folder, and when it is done records that in
``parts/rank-{r}-of-{w}.json``. The files themselves carry nothing about parts, so they stay byte-identical
to one process's. Two mistakes would otherwise go unnoticed until a node computes someone else's rows for
days or a row is never computed: nodes started with different ``extract.world_size`` (their ranges overlap
and leave a gap), and a rank never started (a gap). A node refuses to start when a finished part of another
world size overlaps its rows; the join (the single-node ``dvc repro extract`` on one node) refuses parts that
overlap or leave a gap instead of quietly computing the gap on one node, then removes the records so that the
joined folder is exactly what one process writes.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from eaglenest.core.atomic import atomic_write_json
from eaglenest.core.errors import EaglenestError

PARTS_DIR = "parts"


def part_rows(num_rows: int, rank: int, world_size: int, rows_per_shard: int = 1) -> range:
    """The contiguous slice of rows that node ``rank`` of ``world_size`` extracts: whole shards of
    ``rows_per_shard`` rows, so that no shard is written by two nodes."""
    shards = -(-num_rows // rows_per_shard)
    first, stop = shards * rank // world_size, shards * (rank + 1) // world_size
    return range(min(first * rows_per_shard, num_rows), min(stop * rows_per_shard, num_rows))


@dataclass(frozen=True)
class PartRecord:
    """A finished part: its rank, world size and rows, for which data and configuration."""

    path: Path
    rank: int
    world_size: int
    start: int
    stop: int
    rows_total: int
    config: str

    @property
    def label(self) -> str:
        return f"rank {self.rank} of extract.world_size {self.world_size} (rows {self.start}..{self.stop - 1})"


def record_path(out_dir: Path, rank: int, world_size: int) -> Path:
    return out_dir / PARTS_DIR / f"rank-{rank}-of-{world_size}.json"


def write_record(out_dir: Path, rank: int, world_size: int, rows: range, rows_total: int, config: str) -> None:
    """Records that this part finished (deterministic content: no times or host names)."""
    path = record_path(out_dir, rank, world_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"rank": rank, "world_size": world_size, "start": rows.start, "stop": rows.stop,
                             "rows_total": rows_total, "config": config})


def read_records(out_dir: Path, rows_total: int, config: str) -> list[PartRecord]:
    """The finished parts of this extraction (same rows and configuration); records of an earlier one, or
    unreadable ones, are deleted: their files are re-validated file by file anyway."""
    records = []
    for path in sorted((out_dir / PARTS_DIR).glob("rank-*-of-*.json")):
        try:
            raw = json.loads(path.read_text())
            record = PartRecord(path, int(raw["rank"]), int(raw["world_size"]), int(raw["start"]),
                                 int(raw["stop"]), int(raw["rows_total"]), str(raw["config"]))
        except (OSError, ValueError, KeyError, TypeError):
            path.unlink(missing_ok=True)
            continue
        if record.rows_total != rows_total or record.config != config:
            path.unlink(missing_ok=True)
            continue
        records.append(record)
    return records


def check_part_start(out_dir: Path, rank: int, world_size: int, rows: range, rows_total: int, config: str) -> None:
    """Refuses a node whose rows overlap a finished part of another ``extract.world_size``."""
    for record in read_records(out_dir, rows_total, config):
        if record.world_size != world_size and record.start < rows.stop and rows.start < record.stop:
            raise EaglenestError(
                f"{record.path}: {record.label} finished in this folder, and this node runs rank {rank} of "
                f"extract.world_size {world_size} (rows {rows.start}..{rows.stop - 1}): their rows overlap. Every "
                f"node of one extraction needs the same extract.world_size; to split the rows differently on "
                f"purpose, delete {out_dir / PARTS_DIR} first"
            )


def check_join(out_dir: Path, rows_total: int, config: str, rows_per_shard: int = 1) -> None:
    """The single-node run over a folder that parts wrote into: refuses overlapping parts and uncovered rows,
    naming the fix; then forgets the parts (the folder is now one extraction)."""
    records = read_records(out_dir, rows_total, config)
    if not records:
        shutil.rmtree(out_dir / PARTS_DIR, ignore_errors=True)
        return
    sizes = sorted({record.world_size for record in records})
    if len(sizes) > 1:
        first = next(r for r in records if r.world_size == sizes[0])
        other = next(r for r in records if r.world_size == sizes[1])
        raise EaglenestError(
            f"{out_dir / PARTS_DIR}: parts of different extract.world_size wrote here ({first.label}; "
            f"{other.label}), so their rows overlap and may leave others out; rerun the nodes with one "
            f"extract.world_size, or delete {out_dir / PARTS_DIR} to compute what is missing on this node"
        )
    world_size = sizes[0]
    done = {record.rank for record in records}
    missing = [rank for rank in range(world_size) if rank not in done]
    if missing:
        rows = part_rows(rows_total, missing[0], world_size, rows_per_shard)
        raise EaglenestError(
            f"{out_dir / PARTS_DIR}: rows {rows.start}..{rows.stop - 1} have no finished part (ranks {missing} of "
            f"extract.world_size {world_size} never finished); run them with `python stages/extract.py ... --rank "
            f"{missing[0]} --world-size {world_size}`, or delete {out_dir / PARTS_DIR} to compute them on this node"
        )
    shutil.rmtree(out_dir / PARTS_DIR)
