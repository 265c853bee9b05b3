"""``eaglenest remote`` against a real SeaweedFS store: start, status, stop, DVC push and pull through it, and its
faults: wrong credentials, the store down mid-way, an object corrupted in the store."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from eaglenest.commands.remote import STATE_FILE, store_status
from tests.fixtures.pipeline import VENV_BIN, run
from tests.fixtures.store import dvc_remote, eaglenest_remote


def dvc_repo(path: Path) -> Path:
    path.mkdir()
    run(["git", "init", "-q"], path)
    run([str(VENV_BIN / "dvc"), "init", "-q"], path)
    return path


def error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("ERROR")]


def listening_ports(pid: int) -> list[str]:
    """The addresses the process listens on (ss)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    return [line.split()[3] for line in out.splitlines() if f"pid={pid}," in line]


def test_start_status_stop_and_push_pull(tmp_path: Path) -> None:
    repo, store = dvc_repo(tmp_path / "repo"), tmp_path / "store"
    started = eaglenest_remote("start", repo, store)
    assert started.returncode == 0 and "DVC remote 'team'" in started.stdout, started.stderr
    state = store_status(store)
    assert state is not None
    assert listening_ports(state.pid) and all(a.startswith("127.0.0.1:") for a in listening_ports(state.pid))
    # the credentials stay out of git: only .dvc/config.local (ignored) names the remote
    assert "team" not in (repo / ".dvc" / "config").read_text()
    assert state.secret_key in (repo / ".dvc" / "config.local").read_text()
    assert run(["git", "check-ignore", ".dvc/config.local"], repo).returncode == 0
    assert eaglenest_remote("status", repo, store).returncode == 0

    (repo / "data.txt").write_text("rows\n")
    run([str(VENV_BIN / "dvc"), "add", "-q", "data.txt"], repo)
    assert dvc_remote(["push"], repo).returncode == 0
    (repo / "data.txt").unlink()
    run([str(VENV_BIN / "dvc"), "cache", "dir", str(tmp_path / "empty-cache")], repo)  # as a fresh machine
    assert dvc_remote(["pull"], repo).returncode == 0
    assert (repo / "data.txt").read_text() == "rows\n"

    stopped = eaglenest_remote("stop", repo, store)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    assert store_status(store) is None and (store / STATE_FILE).is_file()
    down = eaglenest_remote("status", repo, store)
    assert down.returncode == 1 and "eaglenest remote start" in down.stdout


def test_faults_wrong_credentials_store_down_corrupt_object(tmp_path: Path) -> None:
    repo, store = dvc_repo(tmp_path / "repo"), tmp_path / "store"
    assert eaglenest_remote("start", repo, store).returncode == 0
    try:
        for name in ("a", "b"):
            (repo / f"{name}.txt").write_text(name * 1000)
        run([str(VENV_BIN / "dvc"), "add", "-q", "a.txt", "b.txt"], repo)

        # wrong credentials: one line, and nothing pushed
        config_local = repo / ".dvc" / "config.local"
        good = config_local.read_text()
        state = json.loads((store / STATE_FILE).read_text())
        config_local.write_text(good.replace(state["secret_key"], "not-the-secret"))
        wrong = dvc_remote(["push"], repo)
        assert wrong.returncode != 0 and len(error_lines(wrong)) == 1, wrong.stderr
        assert "SignatureDoesNotMatch" in error_lines(wrong)[0] and "Traceback" not in wrong.stderr
        config_local.write_text(good)

        # the store down: one line; after a restart (same credentials and ports) the push completes
        assert eaglenest_remote("stop", repo, store).returncode == 0
        down = dvc_remote(["push"], repo)
        assert down.returncode != 0 and len(error_lines(down)) == 1, down.stderr
        assert "Could not connect to the endpoint URL" in error_lines(down)[0]
        assert eaglenest_remote("start", repo, store).returncode == 0
        assert dvc_remote(["push"], repo).returncode == 0
        assert "in sync" in dvc_remote(["status", "-c"], repo).stdout

        # an object whose bytes changed in the store: the pull refuses it and the workspace keeps no such file
        import s3fs

        live = store_status(store)
        assert live is not None
        fs = s3fs.S3FileSystem(key=live.access_key, secret=live.secret_key,
                               client_kwargs={"endpoint_url": live.endpoint})
        a_hash = (repo / "a.txt.dvc").read_text().split("md5: ")[1].split()[0]
        fs.pipe(f"{live.bucket}/eaglenest/files/md5/{a_hash[:2]}/{a_hash[2:]}", b"tampered")
        (repo / "a.txt").unlink()
        run([str(VENV_BIN / "dvc"), "cache", "dir", str(tmp_path / "empty-cache")], repo)
        pulled = dvc_remote(["pull", "a.txt"], repo)
        assert pulled.returncode != 0, pulled.stdout
        assert not (repo / "a.txt").exists()
    finally:
        eaglenest_remote("stop", repo, store)


def test_status_without_a_store(tmp_path: Path) -> None:
    result = eaglenest_remote("status", dvc_repo(tmp_path / "repo"), tmp_path / "none")
    assert result.returncode == 1 and result.stdout.count("\n") == 1


def test_prepare_s_caches_travel_as_a_merge(tmp_path: Path) -> None:
    from eaglenest.commands.remote import cache_folders

    mine, theirs, store = dvc_repo(tmp_path / "mine"), dvc_repo(tmp_path / "theirs"), tmp_path / "store"
    replies, prompts = cache_folders()
    (mine / replies).mkdir(parents=True)
    (mine / replies / "aaa.json").write_text('["a reply"]')
    (theirs / prompts).mkdir(parents=True)
    (theirs / prompts / "bbb.json").write_text('["a prompt"]')
    assert eaglenest_remote("start", mine, store).returncode == 0
    try:
        assert eaglenest_remote("start", theirs, store).returncode == 0  # the running store, configured
        pushed = eaglenest_remote("push-caches", mine, store)
        assert pushed.returncode == 0 and "1 cache entries copied" in pushed.stdout, pushed.stderr
        assert eaglenest_remote("push-caches", theirs, store).returncode == 0
        pulled = eaglenest_remote("pull-caches", theirs, store)
        assert pulled.returncode == 0 and "1 cache entries copied" in pulled.stdout, pulled.stderr
        assert (theirs / replies / "aaa.json").read_text() == '["a reply"]'
        assert eaglenest_remote("pull-caches", mine, store).returncode == 0
        assert (mine / prompts / "bbb.json").read_text() == '["a prompt"]'
        assert not [p for p in (theirs / replies).iterdir() if p.name.endswith(".partial")]
    finally:
        eaglenest_remote("stop", mine, store)
    down = eaglenest_remote("push-caches", mine, store)
    assert down.returncode != 0 and len(down.stderr.strip().splitlines()) == 1, down.stderr
    assert "eaglenest remote status" in down.stderr
