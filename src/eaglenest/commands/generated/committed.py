"""The committed run: the measurements the committed docs are drawn from, as git and the committed dvc.lock hold them.

``make demo`` on a fresh clone reruns the pipeline, so the workspace's ``metrics/``, ``dvc.lock`` and
``dvclive/train`` then hold this host's run, while README.md and docs/ still show the run that was committed with
them, which is right until someone commits the new one. :func:`committed_view` gathers the committed run's sources
in a scratch folder (files git tracks with ``git show HEAD:path``; ``dvclive/train`` from the workspace or the DVC
cache by the md5 the committed dvc.lock records), so a check of the docs compares them with the run they show.
:func:`check` is that check: a generated file is fresh when its generator writes it from the committed run or from
the workspace's; where the workspace holds another run it says so instead of calling the docs stale.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from eaglenest.artifacts.serving_plan import PLAN_FILE
from eaglenest.commands.generated.blocks import Generated, stale, write
from eaglenest.commands.generated.concurrency import SERVE_RECORD
from eaglenest.commands.generated.training import CURVES_DIR, folder_md5, locked_md5
from eaglenest.commands.report.revisions import DETAILS, EVAL_METRICS
from eaglenest.core.errors import InputFileError

LOCK_FILE = "dvc.lock"
# The files git tracks that the generated files are drawn from (dvclive/train is DVC's, read by dvc.lock's md5).
TRACKED_SOURCES = (EVAL_METRICS, DETAILS, SERVE_RECORD, PLAN_FILE.as_posix(), LOCK_FILE)


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, check=False)


def _committed_curves_md5(repo: Path) -> str | None:
    """The md5 of dvclive/train that HEAD's dvc.lock records; None outside git or where it records none."""
    shown = _git(repo, "show", f"HEAD:{LOCK_FILE}")
    if shown.returncode != 0:
        return None
    with tempfile.TemporaryDirectory() as scratch:
        (Path(scratch) / LOCK_FILE).write_bytes(shown.stdout)
        try:
            return locked_md5(Path(scratch))
        except InputFileError:
            return None


def other_run(repo: Path) -> list[str]:
    """The sources where the workspace holds another run than HEAD's (empty outside a git repository).

    Only sources present in the workspace count: an output a clone has not pulled is no other run.
    """
    if _git(repo, "rev-parse", "--verify", "--quiet", "HEAD").returncode != 0:
        return []
    listed = _git(repo, "diff", "--name-only", "HEAD", "--", *TRACKED_SOURCES)
    moved = [name for name in listed.stdout.decode().split() if (repo / name).is_file()]
    curves = repo / CURVES_DIR
    if curves.is_dir() and any(curves.iterdir()):
        committed = _committed_curves_md5(repo)
        if committed is not None and folder_md5(curves) != committed:
            moved.append(CURVES_DIR)
    return moved


def cache_path(repo: Path, md5: str) -> Path:
    """Where DVC's local cache keeps the object ``md5`` (DVC 3's layout, ``files/md5/ab/cdef...``)."""
    return repo / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]


def _curves_from_cache(repo: Path, md5: str, into: Path) -> bool:
    """Copies the folder output ``md5`` (a ``.dir`` object) out of the local DVC cache; False where it lacks any
    of its files."""
    listing = cache_path(repo, md5)
    try:
        entries = json.loads(listing.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    objects = [(cache_path(repo, entry["md5"]), into / entry["relpath"]) for entry in entries]
    if not all(source.is_file() for source, _ in objects):
        return False
    for source, target in objects:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    return True


def committed_view(repo: Path, targets: tuple[Generated, ...], into: Path) -> Path:
    """``into`` filled with the generated files as the workspace holds them and the sources of HEAD's run.

    dvclive/train is there where the workspace's or the DVC cache's is the one HEAD's dvc.lock records; elsewhere
    it is left out, and the training figure is checked by the md5 it records it was drawn from.
    """
    for target in targets:
        if (repo / target.path).is_file():
            (into / target.path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(repo / target.path, into / target.path)
    for source in TRACKED_SOURCES:
        shown = _git(repo, "show", f"HEAD:{source}")
        if shown.returncode == 0:
            (into / source).parent.mkdir(parents=True, exist_ok=True)
            (into / source).write_bytes(shown.stdout)
    committed = _committed_curves_md5(repo)
    curves = repo / CURVES_DIR
    if committed is not None:
        if curves.is_dir() and any(curves.iterdir()) and folder_md5(curves) == committed:
            shutil.copytree(curves, into / CURVES_DIR)
        elif not _curves_from_cache(repo, committed, into / CURVES_DIR):
            shutil.rmtree(into / CURVES_DIR, ignore_errors=True)
    return into


def _fresh_in_workspace(repo: Path, target: Generated) -> bool:
    try:
        return not stale(repo, (target,))
    except InputFileError:  # this run's sources are incomplete (curves not the locked ones): not drawn from it
        return False


def check(repo: Path, targets: tuple[Generated, ...]) -> tuple[list[str], list[str]]:
    """``(problems, notes)``: one line per target that neither the committed run nor the workspace's renders as
    it stands, and where the workspace holds another run, a note that says so."""
    moved = other_run(repo)
    if not moved:
        return stale(repo, targets), []
    with tempfile.TemporaryDirectory() as scratch:
        view = committed_view(repo, targets, Path(scratch))
        problems = [
            line for target in targets for line in stale(view, (target,)) if not _fresh_in_workspace(repo, target)
        ]
    note = (
        f"the workspace holds another run than the one committed ({', '.join(moved)} differ from HEAD): "
        "checked the docs against the committed run; to show this run, `eaglenest report --docs` and commit "
        "it with its measurements"
    )
    return problems, [note]


def regenerate(repo: Path, targets: tuple[Generated, ...], check_only: bool) -> int:
    """Writes ``targets`` from the workspace (or with ``check_only`` only checks them); prints what it did;
    returns the exit status."""
    if check_only:
        problems, notes = check(repo, targets)
        print(
            "\n".join([*notes, *problems])
            if problems
            else "\n".join([*notes, f"up to date: {', '.join(t.path for t in targets)}"])
        )
        return 1 if problems else 0
    moved = other_run(repo)
    done = write(repo, targets)
    if moved:
        done.append(
            f"drawn from the workspace's run, not the committed one ({', '.join(moved)} differ from HEAD): "
            "commit them with the docs"
        )
    print("\n".join(done) if done else "nothing to write: all up to date")
    return 0
