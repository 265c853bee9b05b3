"""An extraction on disk while it runs: finished files kept outside the DVC output, moved in at the end.

``data/hidden_states`` is a plain DVC output (no ``persist``): DVC deletes it before re-running the stage, and
its run-cache restores an earlier extraction instead of recomputing it. What a run has finished so far lives
next to it, in ``data/hidden_states.unfinished/`` (same filesystem: moving it in is a rename): a file appears
there complete or not at all, and when every file of the layout is there, they are linked into the output and
the folder is removed. A run killed at any moment (even between the two) loses no finished file: the next run
finds them there, checks each one, and computes only the rest.

A shard computed in several tasks is written by the stage's own process as their rows arrive, into a preallocated
temporary file renamed into place once its last row is in (:meth:`Extraction.accept_rows`): it too appears complete
or not at all, and a run killed mid-shard leaves only the temporary, which the next run deletes before it computes
that shard's rows again.

A file counts as finished only if it is exactly the file of the layout: its header, shapes and dtype, its length
on disk, the extraction's fingerprint (verifier, layers, dtype), every row's token ids and its data against its
checksum (a file renamed into place just before a power loss can hold zeros under a good header). Files of the same
fingerprint that no longer fit the layout (another ``extract.rows_per_shard``, rows added) keep their rows: a
file whose rows are all held by such files is assembled from them without computing a row (:meth:`copy_from_earlier`).
Anything else is deleted.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from eaglenest.artifacts.hidden_states.format import (
    ROW_INDEX_KEY,
    TOKENS_KEY,
    HiddenStateFileError,
    check_header,
    check_shard_header,
    read_shard_row,
    read_shard_tensor,
    recorded_in,
    row_file_number,
    stored_files,
    verify_checksum,
)
from eaglenest.artifacts.hidden_states.layout import FileLayout, FileSink, FileWriter, HiddenStatePlan, ShardSpec
from eaglenest.core.atomic import atomic_write_bytes, fsync_directory, remove_stale_temps
from eaglenest.core.errors import EaglenestError

log = logging.getLogger(__name__)

UNFINISHED_SUFFIX = ".unfinished"
EARLIER = "earlier"  # files of the same fingerprint in another layout, whose rows may still serve
# Files recomputed for one reason are logged this many times by name, then counted: a changed dtype or verifier
# invalidates every file, and a million log lines would hide everything else.
SHOW_RECOMPUTED = 3


def unfinished_dir(out_dir: Path) -> Path:
    """Where a running extraction keeps its finished files: next to the output, outside it."""
    return out_dir.with_name(out_dir.name + UNFINISHED_SUFFIX)


def file_problem(path: Path, spec: ShardSpec, plan: HiddenStatePlan) -> str | None:
    """Why ``path`` is not ``spec``'s finished file (header and row index, every row's token ids, then its data
    against its checksum), or None; "missing" when there is no file."""
    ids = plan.input_ids
    if spec.row_files:
        problem = check_header(
            path,
            seq_len=len(ids[spec.number]),
            num_slots=plan.num_slots,
            hidden_size=plan.hidden_size,
            dtype=plan.dtype,
            config=plan.config,
        )
    else:
        problem = check_shard_header(
            path,
            rows=spec.rows,
            lengths=[len(row) for row in ids],
            num_slots=plan.num_slots,
            hidden_size=plan.hidden_size,
            dtype=plan.dtype,
            config=plan.config,
            rows_per_shard=spec.rows_per_shard,
        )
    if problem is not None:
        return problem
    try:
        tokens = read_shard_tensor(path, TOKENS_KEY)
    except HiddenStateFileError as err:
        return err.problem
    if tokens.tolist() != [token for row in spec.rows for token in ids[row]]:
        return "token_ids differ from the prepared rows"
    return verify_checksum(path)


@dataclass(frozen=True)
class RowSource:
    """Where a valid copy of one row lies in an earlier file: the file, and its first token and length there."""

    path: Path
    first: int
    length: int
    shard: bool


class Extraction:
    """The finished files of one extraction, in ``data/hidden_states.unfinished/`` until all are there.

    Args:
        out_dir: ``data/hidden_states`` (the DVC output).
        plan: Every file of the layout and what each must hold.
    """

    def __init__(self, out_dir: Path, plan: HiddenStatePlan) -> None:
        self.out_dir, self.plan = Path(out_dir), plan
        self.dir = unfinished_dir(self.out_dir)
        self.finished: set[str] = set()
        self.sources: dict[int, RowSource] = {}
        self.removed = 0
        self.writing: dict[str, FileWriter] = {}  # shards whose rows are arriving (accept_rows), by name

    def collect(self) -> list[ShardSpec]:
        """Keeps every finished file (from an interrupted run, or an output already there), sets aside the files
        whose rows may still serve, deletes the rest; returns the files of the plan still to write."""
        earlier = self.dir / EARLIER
        earlier.mkdir(parents=True, exist_ok=True)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.removed = sum(remove_stale_temps(folder) for folder in (self.dir, earlier, self.out_dir))
        planned = {spec.name: spec for spec in self.plan.files}
        reasons: Counter[str] = Counter()
        for path in stored_files(self.dir) + stored_files(earlier) + stored_files(self.out_dir):
            spec = planned.get(path.name)
            if spec is not None and spec.name not in self.finished:
                problem = file_problem(path, spec, self.plan)
                if problem is None:
                    if path != self.path(spec):
                        os.replace(path, self.path(spec))
                    self.finished.add(spec.name)
                    continue
                reasons[problem] += 1
                if reasons[problem] <= SHOW_RECOMPUTED:
                    log.info("recomputing %s: %s", path.name, problem)
            same = (spec is None or spec.name not in self.finished) and (
                recorded_in(path, "config") == self.plan.config
            )
            if same and path.parent == earlier:
                continue
            if same and not (earlier / path.name).exists():
                os.replace(path, earlier / path.name)  # another layout of the same rows: they may still serve
            else:
                path.unlink()
                self.removed += 1
        for problem, count in reasons.items():
            if count > SHOW_RECOMPUTED:
                log.info("recomputing %d files in all: %s", count, problem)
        for entry in self.out_dir.iterdir():  # whatever else: a manifest of store: online, records of old layouts
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        self.sources = self._earlier_rows(earlier)
        return [spec for spec in self.plan.files if spec.name not in self.finished]

    def _earlier_rows(self, earlier: Path) -> dict[int, RowSource]:
        """Every row of the earlier files whose length and token ids still match its prepared row."""
        ids, sources = self.plan.input_ids, {}
        for path in stored_files(earlier):
            problem = verify_checksum(path)
            if problem is not None:  # its rows would be copied as they are, checksum and all
                log.info("not reusing the rows of %s: %s", path.name, problem)
                continue
            row = row_file_number(path)
            try:
                if row is not None:
                    entries = [(row, 0, len(ids[row]) if row < len(ids) else -1)]
                else:
                    index = read_shard_tensor(path, ROW_INDEX_KEY)
                    entries = [] if index.dim() != 2 else [tuple(e) for e in index.tolist()]
                tokens = read_shard_tensor(path, TOKENS_KEY).tolist()
            except HiddenStateFileError:  # read a moment ago for its checksum: gone or changed since, nothing to reuse
                continue
            for row, first, length in entries:
                if 0 <= row < len(ids) and length == len(ids[row]) and tokens[first : first + length] == ids[row]:
                    sources[row] = RowSource(path, first, length, shard=row_file_number(path) is None)
        return sources

    def can_copy(self, spec: ShardSpec) -> bool:
        """Whether earlier files hold every row of ``spec`` (it is then assembled, not computed)."""
        return all(row in self.sources for row in spec.rows)

    def copy_from_earlier(self, layout: FileLayout) -> None:
        """Writes ``layout``'s file from the rows earlier files hold, their bytes as stored."""
        writer = FileWriter(layout, FileSink(layout, self.dir / layout.spec.name))
        try:
            for row in layout.spec.rows:
                source = self.sources[row]
                with safe_open(str(source.path), framework="pt") as handle:
                    stored = read_shard_row(handle, source.first, source.length)
                stored.pop(TOKENS_KEY)
                writer.write_row(row, stored)
        except (OSError, SafetensorError, RuntimeError) as err:
            writer.abort()
            raise EaglenestError(f"{layout.spec.label}: could not copy its rows from earlier files: {err}") from None
        writer.finish()
        self.finished.add(layout.spec.name)

    def path(self, spec: ShardSpec) -> Path:
        """Where ``spec``'s finished file goes while the extraction runs."""
        return self.dir / spec.name

    def accept_bytes(self, spec: ShardSpec, data: Any) -> None:
        """A finished file's bytes, computed elsewhere (a Ray worker): written once, atomically."""
        if spec.name in self.finished:
            raise EaglenestError(f"{spec.label}: finished twice")  # the dispatcher hands out each task once
        atomic_write_bytes(self.path(spec), data)  # fsync'd: see FileSink
        self.finished.add(spec.name)

    def accept_rows(self, spec: ShardSpec, rows: list[tuple[int, dict[str, Any]]]) -> bool:
        """Rows of ``spec``'s file computed elsewhere (a task of some of its rows), as stored, written at their
        places in its preallocated temporary file; the file is renamed into place (its checksum from the rows'
        digests) once its last row is in. Returns whether it is finished. Memory stays at the rows given.

        A run that stops before the last row leaves no file under the name: the next run computes its rows again.
        """
        writer = self.writing.get(spec.name)
        if writer is None:
            if spec.name in self.finished:
                raise EaglenestError(f"{spec.label}: finished twice")  # the dispatcher hands out each task once
            layout = self.plan.layout(spec)
            writer = self.writing[spec.name] = FileWriter(layout, FileSink(layout, self.path(spec)))
        for row, stored in rows:
            writer.write_row(row, stored)
        if writer.missing:
            return False
        del self.writing[spec.name]
        writer.finish()
        self.finished.add(spec.name)
        return True

    def abort_unfinished(self) -> None:
        """Deletes the temporary files of shards whose rows did not all arrive (the run stops)."""
        for writer in self.writing.values():
            writer.abort()
        self.writing.clear()

    def accept_file(self, spec: ShardSpec) -> None:
        """A finished file a worker wrote into this folder itself (``cluster.output: shared``), checked."""
        problem = file_problem(self.path(spec), spec, self.plan)
        if problem is not None:
            raise EaglenestError(
                f"{self.path(spec)}: the worker's file is not the one expected: {problem}; is "
                f"{self.dir} on a filesystem every node mounts at the same path?"
            )
        self.finished.add(spec.name)

    def finish(self) -> None:
        """Every file is finished: links them into the output, then removes the unfinished folder (a kill between
        the two leaves both, and the next run keeps them)."""
        missing = [spec.label for spec in self.plan.files if spec.name not in self.finished]
        if missing:
            raise EaglenestError(f"{len(missing)} files were not written (first: {missing[0]})")
        for spec in self.plan.files:
            target = self.out_dir / spec.name
            target.unlink(missing_ok=True)
            try:
                os.link(self.path(spec), target)
            except OSError:  # a filesystem without hard links
                shutil.copyfile(self.path(spec), target)
        # the output's names must be on the disk before the only other copy of the files' names goes
        fsync_directory(self.out_dir)
        shutil.rmtree(self.dir)

    def stored_size(self) -> int:
        """Bytes of the finished files (before :meth:`finish`)."""
        return sum(self.path(spec).stat().st_size for spec in self.plan.files)
