"""``eaglenest remote push|pull``: DVC's objects and run-cache (``dvc push|pull --run-cache``, stopped where the
remote's endpoint goes silent), the pulled run-cache checked against its names, then prepare's caches, each entry
travelling with the sha256 of its bytes. :func:`run_dvc` runs the experiments' DVC commands too.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from eaglenest.commands.remote.dvc_config import DEFAULT_REMOTE, PAST, DvcRemote, dvc_remote
from eaglenest.commands.remote.store import STOP_TIMEOUT_S, answers
from eaglenest.core.errors import EaglenestError

# Under the remote's root, beside DVC's files/: prepare's caches of regenerated replies and self-instruct prompts.
CACHES_PREFIX = "eaglenest-caches"
# Beside each of their entries: the sha256 of its bytes (a sidecar object: any DVC remote holds one, S3 or not).
CHECKSUM_SUFFIX = ".sha256"
# DVC runs as a child of this interpreter: the project's own DVC, with its S3 plugin.
DVC = (sys.executable, "-m", "dvc")
# A push or pull whose endpoint stops answering this long is stopped. DVC does not stop by itself: with the store
# gone mid-transfer, s3fs and botocore retry every object with back-off (a push of 3,000 objects was still waiting
# 14 minutes after its store stopped; one whose store was down from the start fails at once).
DOWN_AFTER_S = 8.0
PROBE_INTERVAL_S = 1.0


def _interrupt(process: subprocess.Popen[str]) -> None:
    """Stops DVC as Ctrl-C does (it exits at once, keeping what it transferred); SIGKILL if it lingers."""
    process.send_signal(signal.SIGINT)
    try:
        process.communicate(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()


def run_dvc(repo: Path, args: list[str], remote: DvcRemote, verb: str) -> str:
    """Runs ``dvc ARGS`` in ``repo`` against ``remote``; returns what it printed (its output, then its messages).

    Where the remote's endpoint answers at the start, it is probed while DVC runs, and DVC is stopped once the
    endpoint has been silent for :data:`DOWN_AFTER_S`. One that does not answer at the start is left to DVC, which
    fails at once where the store is down, and succeeds where only a proxy reaches the endpoint.

    Raises:
        EaglenestError: DVC failed, or the endpoint went silent (one line: the remote and what to do).
    """
    address = remote.address()
    watched = address if address is not None and answers(address[1], address[0]) else None
    process = subprocess.Popen(
        [*DVC, *args],
        cwd=repo,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        encoding="utf-8",
        errors="replace",
    )
    silent_since: float | None = None
    while True:
        try:
            out, err = process.communicate(timeout=PROBE_INTERVAL_S)
            break
        except subprocess.TimeoutExpired:
            pass
        except KeyboardInterrupt:  # the terminal's Ctrl-C reached DVC too: it stops by itself
            process.communicate()
            raise EaglenestError(
                f"the {verb} with remote {remote.name!r} was interrupted: run it again, objects "
                f"already {PAST[verb]} stay"
            ) from None
        if watched is None:
            continue
        if answers(watched[1], watched[0]):
            silent_since = None
        elif silent_since is None:
            silent_since = time.monotonic()
        elif time.monotonic() - silent_since >= DOWN_AFTER_S:
            _interrupt(process)
            raise EaglenestError(remote.down(verb))
    if process.returncode != 0:
        raise EaglenestError(remote.failure(err + out, verb))
    return out + err


def verify_run_cache(repo: Path) -> int:
    """Checks every entry of DVC's run-cache in ``repo`` against its name, and deletes those that do not match.

    DVC names an entry ``runs/KEY[:2]/KEY/VALUE``: VALUE the sha256 of the entry (the stage's command, deps and
    outputs' hashes), KEY that of the same without the outputs' hashes. DVC 3.67 checks neither when it pulls an
    entry or restores a stage from it, and ``dvc pull --run-cache`` overwrites a local entry with the remote's:
    an entry altered in the store would make ``dvc repro`` check out outputs that no run of those deps made.

    Returns:
        How many entries were checked.

    Raises:
        EaglenestError: an entry does not match its name (naming it; it was deleted, with every other such one).
    """
    from dvc.repo import Repo
    from dvc.stage.cache import _get_cache_hash
    from dvc.utils.serialize import load_yaml

    with Repo(str(repo)) as dvc_repo:
        runs = Path(dvc_repo.stage_cache.cache_dir)
    entries = [p for p in runs.glob("*/*/*") if p.is_file()] if runs.is_dir() else []
    altered = []
    for path in entries:
        try:
            entry = load_yaml(str(path))
            matches = (
                _get_cache_hash(dict(entry)) == path.name and _get_cache_hash(dict(entry), key=True) == path.parent.name
            )
        except Exception:  # noqa: BLE001 (any file DVC cannot read as an entry is as altered as a wrong one)
            matches = False
        if not matches:
            path.unlink()
            altered.append(path)
    if altered:
        raise EaglenestError(
            f"DVC's run-cache entry {altered[0]} does not match its name (altered in the remote): "
            f"deleted, with {len(altered) - 1} other such; no stage is restored from it, so "
            f"`dvc repro` runs that stage"
        )
    return len(entries)


def cache_folders() -> tuple[Path, ...]:
    """Prepare's caches (relative to the repository): regenerated replies and self-instruct prompts."""
    from eaglenest.stages.prepare.regenerate import CACHE_ROOT as REPLIES
    from eaglenest.stages.prepare.self_instruct import CACHE_ROOT as PROMPTS

    return REPLIES, PROMPTS


def _sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _push_entries(target: Any, local: Path, remote_dir: str, there: set[str]) -> int:
    """Puts the entries of ``local`` that ``there`` lacks, each with its sha256 beside it (the sidecar after the
    entry: a pull refuses an entry without one); also the sidecar of an entry pushed before sidecars were.
    Returns how many entries were copied."""
    copied = 0
    for entry in sorted(p.name for p in local.glob("*.json")) if local.is_dir() else []:
        if entry not in there:
            target.fs.put_file(str(local / entry), target.fs.join(remote_dir, entry))
            copied += 1
        if entry + CHECKSUM_SUFFIX not in there:
            target.fs.pipe_file(target.fs.join(remote_dir, entry + CHECKSUM_SUFFIX), _sha256(local / entry).encode())
    return copied


def _pull_entries(target: Any, local: Path, remote_dir: str, there: set[str], remote: DvcRemote) -> int:
    """Gets the entries of ``remote_dir`` that ``local`` lacks, each checked against the sha256 pushed beside it
    before it gets its name (prepare trusts any file under an entry's name). Returns how many were copied.

    Raises:
        EaglenestError: an entry without its sha256, or whose bytes differ from it (naming the entry; nothing of it
            is kept).
    """
    local.mkdir(parents=True, exist_ok=True)
    entries = {name for name in there if not name.endswith(CHECKSUM_SUFFIX)}
    missing = sorted(entries - {p.name for p in local.glob("*.json")})
    for entry in missing:
        where = target.fs.join(remote_dir, entry)
        if entry + CHECKSUM_SUFFIX not in there:
            raise EaglenestError(
                f"prepare's cache entry {where} on {remote} has no sha256 beside it (pushed by an "
                f"older eaglenest, or altered): nothing of it was kept; a clone that has the "
                f"entry pushes its sha256 with `eaglenest remote push`"
            )
        expected = target.fs.cat_file(where + CHECKSUM_SUFFIX).decode().strip()
        partial = local / f".{entry}.partial"  # a partial or refused download never carries an entry's name
        try:
            target.fs.get_file(where, str(partial))
            if _sha256(partial) != expected:
                raise EaglenestError(
                    f"prepare's cache entry {where} on {remote} does not match the sha256 it was "
                    f"pushed with (its bytes changed in the store): nothing of it was kept; "
                    f"delete it there and push it again from a clone that made it"
                )
            os.replace(partial, local / entry)
        finally:
            partial.unlink(missing_ok=True)
    return len(missing)


def sync_caches(repo: Path, direction: str, remote: DvcRemote) -> int:
    """Copies prepare's cache entries the other side lacks, to (``push``) or from (``pull``) the DVC remote.

    The caches are no DVC output: an output would be deleted before each run (or be ``persist``, which keeps DVC's
    run-cache from the stage), and prepare reuses them after any param change. Their entries are files named by
    the hash of everything that made them (not of their bytes) and never rewritten, so a copy of the missing ones
    is a safe merge of two machines' caches; each travels with the sha256 of its bytes, which a pull checks.
    Returns how many entries were copied.

    Raises:
        EaglenestError: the remote unreachable or refusing, or an entry refused (one line naming it).
    """
    from botocore.exceptions import BotoCoreError  # an S3 endpoint unreachable (dvc-s3 is a dependency)
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    copied = 0
    try:
        with Repo(str(repo)) as dvc_repo:
            target = dvc_repo.cloud.get_remote(remote.name, "eaglenest remote")
            for folder in cache_folders():
                remote_dir = target.fs.join(target.path, CACHES_PREFIX, folder.name)
                there = {target.fs.name(p) for p in target.fs.find(remote_dir)}
                if direction == "push":
                    copied += _push_entries(target, repo / folder, remote_dir, there)
                else:
                    copied += _pull_entries(target, repo / folder, remote_dir, there, remote)
    except (DvcException, OSError, BotoCoreError) as err:
        # s3fs turns botocore's error into an OSError of the server's message; its cause names the S3 error code
        said = f"ERROR: {err} ({err.__cause__})" if err.__cause__ else f"ERROR: {err}"
        raise EaglenestError(f"prepare's caches: {remote.failure(said, direction)}") from None
    return copied


def transfer(repo: Path, direction: str, name: str, targets: list[str], dvc_flags: list[str]) -> list[str]:
    """``eaglenest remote push|pull``: ``dvc push|pull --run-cache -r NAME`` (flags, then targets), then prepare's
    caches; returns DVC's lines and the caches' count.

    Raises:
        EaglenestError: a flag names DVC's remote (``--name`` does), or the transfer failed (one line).
    """
    if any(flag in ("-r", "--remote") or flag.startswith(("-r", "--remote=")) for flag in dvc_flags):
        raise EaglenestError(
            f"the DVC remote is --name (default: {DEFAULT_REMOTE}), not DVC's -r: the push, the "
            "pull and prepare's caches go to one remote"
        )
    remote = dvc_remote(repo, name)
    said = run_dvc(repo, [direction, "--run-cache", "-r", remote.name, *dvc_flags, *targets], remote, direction)
    if direction == "pull":
        verify_run_cache(repo)
    copied = sync_caches(repo, direction, remote)
    folders = ", ".join(str(f) for f in cache_folders())
    return [*said.strip().splitlines(), f"{direction}: {copied} cache entries copied ({folders})"]
