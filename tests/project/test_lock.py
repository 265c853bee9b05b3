"""The committed dvc.lock against what a fresh clone holds: the data folders stages read from git must hash in the
lock as git holds them, or a fresh clone's pipeline is out of date before it runs (a folder hashed with files the
committer had locally and git does not carry, such as served-traffic recordings in data/traffic)."""

from __future__ import annotations

import hashlib
import json
import subprocess

import yaml

from tests.fixtures.pipeline import REPO


def git(*args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True).stdout


def dvc_folder_md5(folder: str) -> str:
    """DVC's md5 of ``folder`` as HEAD holds it: the md5 of its sorted listing of (md5, relative path), + ``.dir``."""
    entries = [
        {"md5": hashlib.md5(git("show", f"HEAD:{path}")).hexdigest(), "relpath": path.removeprefix(f"{folder}/")}
        for path in git("ls-files", "--", folder).decode().split()
    ]
    listing = json.dumps(sorted(entries, key=lambda entry: entry["relpath"]), sort_keys=True)
    return hashlib.md5(listing.encode()).hexdigest() + ".dir"


def test_every_data_folder_a_stage_reads_from_git_hashes_in_the_lock_as_git_holds_it():
    lock = yaml.safe_load(git("show", "HEAD:dvc.lock"))["stages"]
    produced = {out["path"] for stage in lock.values() for out in stage.get("outs", [])}
    folders = {
        dep["path"]: dep["md5"]
        for stage in lock.values()
        for dep in stage.get("deps", [])
        if dep.get("md5", "").endswith(".dir") and dep["path"] not in produced
    }
    assert "data/traffic" in folders and "data/conversations" in folders, sorted(folders)
    stale = {path: md5 for path, md5 in folders.items() if md5 != dvc_folder_md5(path)}
    assert stale == {}, f"dvc.lock hashes these folders with files git does not hold: {sorted(stale)}"
