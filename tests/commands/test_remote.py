"""``eaglenest remote`` against a real SeaweedFS store: start, status, stop, push and pull through it, and its
faults, each one line naming the remote and what to do: wrong credentials, the store down mid-push, an object
corrupted in the store, an altered cache entry; and what the store lets others do on a shared host: nothing without
its credentials."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from eaglenest.commands import cli
from eaglenest.commands.remote import start
from eaglenest.commands.remote.store import STATE_FILE, WeedStore, stop_store, store_status
from eaglenest.commands.remote.transfer import DOWN_AFTER_S
from eaglenest.core.errors import EaglenestError
from tests.fixtures.pipeline import VENV_BIN, project_env, run
from tests.fixtures.store import dvc_remote, eaglenest_remote, eaglenest_remote_command, store_dir, use_store  # noqa: F401 (fixture)

MID_PUSH_OBJECTS = 600


def dvc_repo(path: Path) -> Path:
    path.mkdir()
    run(["git", "init", "-q"], path)
    run([str(VENV_BIN / "dvc"), "init", "-q"], path)
    return path


def listening_ports(pid: int) -> list[str]:
    """The addresses the process listens on (ss)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    return [line.split()[3] for line in out.splitlines() if f"pid={pid}," in line]


def test_start_status_stop_and_push_pull(tmp_path: Path) -> None:
    repo, store = dvc_repo(tmp_path / "repo"), tmp_path / "store"
    started = eaglenest_remote("start", repo, "--dir", store)
    assert started.returncode == 0 and "DVC remote 'team'" in started.stdout, started.stderr
    assert "(the default remote)" in started.stdout
    assert (store.stat().st_mode & 0o777) == 0o700  # objects, log and secrets: its owner's only
    state = store_status(store)
    assert state is not None
    assert listening_ports(state.pid) and all(a.startswith("127.0.0.1:") for a in listening_ports(state.pid))
    # the credentials stay out of git: only .dvc/config.local (ignored) names the remote
    assert "team" not in (repo / ".dvc" / "config").read_text()
    assert state.secret_key in (repo / ".dvc" / "config.local").read_text()
    assert run(["git", "check-ignore", ".dvc/config.local"], repo).returncode == 0
    assert eaglenest_remote("status", repo, "--dir", store).returncode == 0

    (repo / "data.txt").write_text("rows\n")
    run([str(VENV_BIN / "dvc"), "add", "-q", "data.txt"], repo)
    assert dvc_remote(["push"], repo).returncode == 0
    (repo / "data.txt").unlink()
    run([str(VENV_BIN / "dvc"), "cache", "dir", str(tmp_path / "empty-cache")], repo)  # as a fresh machine
    assert dvc_remote(["pull"], repo).returncode == 0
    assert (repo / "data.txt").read_text() == "rows\n"

    stopped = eaglenest_remote("stop", repo, "--dir", store)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    assert store_status(store) is None and (store / STATE_FILE).is_file()
    down = eaglenest_remote("status", repo, "--dir", store)
    assert down.returncode == 1 and "eaglenest remote start" in down.stdout


def first_object_in(fs: Any, prefix: str) -> bool:
    """Whether the store holds an object under ``prefix`` now (s3fs caches listings: asked afresh)."""
    fs.invalidate_cache()
    return fs.exists(prefix)


def only_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one line a failed ``eaglenest remote`` printed on stderr, without its command's prefix."""
    lines = result.stderr.splitlines()
    assert result.returncode != 0 and len(lines) == 1, (result.returncode, result.stderr)
    assert lines[0].startswith("eaglenest remote: error: "), lines
    return lines[0].removeprefix("eaglenest remote: error: ")


def test_faults_wrong_credentials_store_down_mid_push_corrupt_object(tmp_path: Path) -> None:
    repo, store = dvc_repo(tmp_path / "repo"), tmp_path / "store"
    assert eaglenest_remote("start", repo, "--dir", store).returncode == 0
    live = store_status(store)
    assert live is not None
    try:
        # many small objects, so that a push one object at a time is still running when the store stops
        (repo / "rows").mkdir()
        for i in range(MID_PUSH_OBJECTS):
            (repo / "rows" / f"{i}.txt").write_text(f"{i}\n" * 20)
        (repo / "a.txt").write_text("a" * 1000)
        run([str(VENV_BIN / "dvc"), "add", "-q", "a.txt", "rows"], repo)

        # wrong credentials: one line naming the remote and the fix, and nothing pushed
        config_local = repo / ".dvc" / "config.local"
        good = config_local.read_text()
        config_local.write_text(good.replace(live.secret_key, "not-the-secret"))
        wrong = only_line(eaglenest_remote("push", repo))
        assert wrong.startswith(
            f"remote 'team' (s3://dvc/eaglenest at {live.endpoint}) refused the credentials in .dvc/config.local"
        ), wrong
        config_local.write_text(good)

        # the store down mid-push: one line; after a restart (same credentials and ports) the push sends the rest
        import s3fs

        fs = s3fs.S3FileSystem(
            key=live.access_key, secret=live.secret_key, client_kwargs={"endpoint_url": live.endpoint}
        )
        objects = f"{live.bucket}/eaglenest/files/md5"
        pushing = subprocess.Popen(
            eaglenest_remote_command("push", "--", "--jobs", "1"),
            cwd=repo,
            env=project_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 300
        while not first_object_in(fs, objects) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pushing.poll() is None, "the push ended before the store stopped"
        assert eaglenest_remote("stop", repo, "--dir", store).returncode == 0
        stopped_at = time.monotonic()
        out, err = pushing.communicate(timeout=300)
        down = only_line(subprocess.CompletedProcess(pushing.args, pushing.returncode, out, err))
        assert down == (
            f"remote 'team' (s3://dvc/eaglenest) does not answer at {live.endpoint}: start it "
            "(`eaglenest remote start`) or fix its endpointurl; run the push again, objects already "
            "pushed stay"
        ), down
        assert time.monotonic() - stopped_at < DOWN_AFTER_S + 30  # DVC alone retries for many minutes
        assert eaglenest_remote("start", repo, "--dir", store).returncode == 0
        again = eaglenest_remote("push", repo)
        assert again.returncode == 0, again.stderr
        resent = int(again.stdout.split(" files pushed")[0].split()[-1])
        assert 0 < resent < MID_PUSH_OBJECTS + 2, again.stdout  # the objects pushed before the stop stayed
        assert "in sync" in dvc_remote(["status", "-c"], repo).stdout

        # an object whose bytes changed in the store: the pull refuses it, and the workspace keeps no such file
        a_hash = (repo / "a.txt.dvc").read_text().split("md5: ")[1].split()[0]
        fs.pipe(f"{objects}/{a_hash[:2]}/{a_hash[2:]}", b"tampered")
        (repo / "a.txt").unlink()
        run([str(VENV_BIN / "dvc"), "cache", "dir", str(tmp_path / "empty-cache")], repo)
        refused = only_line(eaglenest_remote("pull", repo, "a.txt"))
        assert refused.startswith(f"remote 'team' (s3://dvc/eaglenest at {live.endpoint}): "), refused
        assert not (repo / "a.txt").exists()
    finally:
        eaglenest_remote("stop", repo, "--dir", store)


@pytest.mark.parametrize(
    "argv",
    [
        ["stop", "extra"],
        ["status", "--name", "team"],
        ["stop", "--force"],
        ["push", "--force"],
        ["push", "--dir", "x"],
        ["exp-push"],
        ["exp-pull", "a", "origin", "more"],
        ["start", "a.txt"],
        ["start", "--", "--jobs", "4"],
        ["exp-push", "wide", "--", "--jobs", "4"],
        ["status", "--", "-v"],
        ["upload"],
    ],
)
def test_an_action_refuses_what_it_does_not_take_in_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.parse(["remote", *argv])
    assert exited.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("eaglenest") and ": error: " in last, last


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["push", "--", "--jobs", "4"],
            {"action": "push", "targets": [], "passthrough_args": ["--jobs", "4"], "name": "team"},
        ),
        (
            ["pull", "models/draft", "--name", "mine", "--", "--jobs", "4"],
            {"targets": ["models/draft"], "name": "mine", "passthrough_args": ["--jobs", "4"]},
        ),
        (["exp-push", "lr-3e-4"], {"experiment": "lr-3e-4", "git_remote": "origin"}),
        (["exp-pull", "lr-3e-4", "upstream"], {"experiment": "lr-3e-4", "git_remote": "upstream"}),
        (
            ["start", "--dir", "../first-clone/.eaglenest/store", "--force"],
            {"dir": "../first-clone/.eaglenest/store", "force": True, "repo": "."},
        ),
    ],
)
def test_each_action_parses_what_it_takes(argv: list[str], expected: dict[str, Any]) -> None:
    args, command = cli.parse(["remote", *argv])
    assert command.name == "remote"
    assert {key: getattr(args, key) for key in expected} == expected


def test_the_store_state_reads_back_as_a_weed_store(store_dir: Path) -> None:
    assert isinstance(store_status(store_dir), WeedStore)


def test_status_without_a_store(tmp_path: Path) -> None:
    result = eaglenest_remote("status", dvc_repo(tmp_path / "repo"), "--dir", tmp_path / "none")
    assert result.returncode == 1 and result.stdout.count("\n") == 1


def test_prepare_s_caches_travel_as_a_merge(tmp_path: Path) -> None:
    from eaglenest.commands.remote.transfer import cache_folders

    mine, theirs, store = dvc_repo(tmp_path / "mine"), dvc_repo(tmp_path / "theirs"), tmp_path / "store"
    replies, prompts = cache_folders()
    (mine / replies).mkdir(parents=True)
    (mine / replies / "aaa.json").write_text('["a reply"]')
    (theirs / prompts).mkdir(parents=True)
    (theirs / prompts / "bbb.json").write_text('["a prompt"]')
    assert eaglenest_remote("start", mine, "--dir", store).returncode == 0
    try:
        assert eaglenest_remote("start", theirs, "--dir", store).returncode == 0  # the running store, configured
        pushed = eaglenest_remote("push", mine)
        assert pushed.returncode == 0 and "push: 1 cache entries copied" in pushed.stdout, pushed.stderr
        assert eaglenest_remote("push", theirs).returncode == 0
        pulled = eaglenest_remote("pull", theirs)
        assert pulled.returncode == 0 and "pull: 1 cache entries copied" in pulled.stdout, pulled.stderr
        assert (theirs / replies / "aaa.json").read_text() == '["a reply"]'
        assert eaglenest_remote("pull", mine).returncode == 0
        assert (mine / prompts / "bbb.json").read_text() == '["a prompt"]'
        assert not [p for p in (theirs / replies).iterdir() if p.name.endswith(".partial")]
    finally:
        eaglenest_remote("stop", mine, "--dir", store)
    # the store down from the start: DVC fails at once, with the same line
    assert "does not answer at http://127.0.0.1:" in only_line(eaglenest_remote("push", mine))


def test_exp_push_refuses_a_name_taken_on_another_baseline(tmp_path: Path, store_dir: Path) -> None:
    git_remote = tmp_path / "team.git"
    run(["git", "init", "-q", "--bare", str(git_remote)], tmp_path)
    repo = dvc_repo(tmp_path / "repo")
    (repo / "params.yaml").write_text("x: 1\n")
    (repo / "dvc.yaml").write_text(
        yaml.safe_dump(
            {
                "stages": {
                    "copy": {
                        "cmd": "python -c \"import shutil; shutil.copy('params.yaml', 'out.txt')\"",
                        "params": ["x"],
                        "outs": ["out.txt"],
                    }
                }
            }
        )
    )
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "base"], repo)
    run(["git", "remote", "add", "origin", str(git_remote)], repo)
    use_store(repo, store_dir)
    run([str(VENV_BIN / "dvc"), "exp", "run", "-q", "-n", "wide", "-S", "x=2"], repo)
    pushed = eaglenest_remote("exp-push", repo, "wide")
    assert pushed.returncode == 0 and "Pushed experiment wide to Git remote 'origin'" in pushed.stdout, pushed.stderr
    pushed_refs = run(["git", "ls-remote", str(git_remote), "refs/exps/*"], tmp_path).stdout

    # the same name on the next commit: DVC would push it beside the first, and `dvc exp pull wide` would then be
    # ambiguous; exp-push refuses it before anything moves
    run(["git", "commit", "-q", "--allow-empty", "-m", "next"], repo)
    run([str(VENV_BIN / "dvc"), "exp", "run", "-q", "-n", "wide", "-S", "x=3"], repo)
    assert only_line(eaglenest_remote("exp-push", repo, "wide", "origin")).startswith(
        "experiment wide on origin is a teammate's with other outputs: rename yours (`dvc exp rename wide NEW`)"
    )
    assert run(["git", "ls-remote", str(git_remote), "refs/exps/*"], tmp_path).stdout == pushed_refs

    assert only_line(eaglenest_remote("exp-push", repo, "narrow")).startswith("no experiment narrow in ")
    assert only_line(eaglenest_remote("exp-push", repo, "wide", "nowhere")) == (
        "Git remote 'nowhere' did not list its experiments: fatal: 'nowhere' does not appear to be a git repository"
    )

    # a Git remote that git would read as an option (--upload-pack runs a command): refused before git runs
    from eaglenest.commands.remote.experiments import exp_pull, exp_push

    marker = tmp_path / "ran"
    for sync in (exp_push, exp_pull):
        with pytest.raises(EaglenestError) as refused:
            sync(repo, "wide", f"--upload-pack=touch {marker}", "team")
        assert str(refused.value).startswith(
            f"the Git remote '--upload-pack=touch {marker}' starts with '-', which git would read as an option"
        ), refused.value
    assert not marker.exists()


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def weeds_on(directory: Path) -> list[int]:
    """The weed processes whose command line names ``directory``'s objects."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:
            continue
        if f"-dir={directory.resolve() / 'data'}".encode() in argv:
            found.append(int(entry.name))
    return found


def http_status(url: str, method: str = "GET", data: bytes | None = None, **headers: str) -> tuple[int, Any]:
    """The status and headers of one request without credentials."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers, method=method), timeout=5) as answer:
            return answer.status, answer.headers
    except urllib.error.HTTPError as err:
        return err.code, err.headers


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # and an empty SETTINGS


def grpc_answers(port: int, tls: bool) -> bool:
    """Whether the port answers an HTTP/2 client (gRPC's transport) that presents no certificate: with a frame."""
    import socket
    import ssl

    try:
        connection = socket.create_connection(("127.0.0.1", port), timeout=5)
        if tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
            context.set_alpn_protocols(["h2"])
            connection = context.wrap_socket(connection)
        with connection:
            connection.sendall(H2_PREFACE)
            return len(connection.recv(64)) >= 9  # a frame header at least
    except (OSError, ssl.SSLError):
        return False


def test_every_port_of_the_store_asks_for_credentials(store_dir: Path) -> None:
    import json

    store = store_status(store_dir)
    assert store is not None
    filer = f"http://127.0.0.1:{store.ports['filer.port']}"
    assert http_status(f"{filer}/buckets/dvc/planted.txt", "PUT", b"planted")[0] in (401, 403)
    assert http_status(f"{filer}/buckets/dvc/")[0] in (401, 403)
    # the master hands out a file id, but the volume server takes no write without the master's signed token
    with urllib.request.urlopen(f"http://127.0.0.1:{store.ports['master.port']}/dir/assign", timeout=5) as answer:
        assigned = json.load(answer)
    written = http_status(f"http://{assigned['url']}/{assigned['fid']}", "PUT", b"planted")
    assert written[0] in (401, 403), written
    assert http_status(f"http://{assigned['url']}/{assigned['fid']}")[0] in (401, 403, 404)
    # the gRPC ports: no plaintext HTTP/2, and no TLS without the store's client certificate
    for flag in ("master.port.grpc", "volume.port.grpc", "filer.port.grpc", "s3.port.grpc"):
        assert not grpc_answers(store.ports[flag], tls=False), flag
        assert not grpc_answers(store.ports[flag], tls=True), flag


def test_no_other_origin_may_call_the_store(store_dir: Path) -> None:
    store = store_status(store_dir)
    assert store is not None
    evil = "http://evil.example"
    for port in (store.ports["s3.port"], store.ports["filer.port"]):
        for method, extra in (("OPTIONS", {"Access-Control-Request-Method": "GET"}), ("GET", {})):
            _, headers = http_status(f"http://127.0.0.1:{port}/dvc/", method, Origin=evil, **extra)
            assert headers.get("Access-Control-Allow-Origin") not in ("*", evil), (port, method, dict(headers))


def test_the_store_s_files_are_its_owner_s_and_weed_reports_to_nobody(store_dir: Path) -> None:
    store = store_status(store_dir)
    assert store is not None
    assert mode(store_dir / "data") == 0o700
    from eaglenest.commands.remote.store import SECURITY_FILE

    assert [mode(store_dir / name) for name in ("weed.log", STATE_FILE, SECURITY_FILE)] == [0o600] * 3
    argv = Path(f"/proc/{store.pid}/cmdline").read_bytes().decode().split("\0")
    assert "-master.telemetry=false" in argv
    assert store.secret_key not in " ".join(argv)


class RecordingPopen(subprocess.Popen):  # type: ignore[type-arg]
    """The real Popen, which also keeps every command line it starts."""

    lines: list[str] = []

    def __init__(self, args: Any, *rest: Any, **kwargs: Any) -> None:
        RecordingPopen.lines.append(" ".join(map(str, args)) if isinstance(args, list | tuple) else str(args))
        super().__init__(args, *rest, **kwargs)


def test_start_shows_the_secret_to_nobody(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    repo, directory = dvc_repo(tmp_path / "repo"), tmp_path / "stores" / "store"
    created: list[tuple[str, int]] = []
    real_open = os.open

    def recording_open(path: Any, flags: int, mode: int = 0o777, **kwargs: Any) -> int:
        if flags & os.O_CREAT:
            created.append((os.fspath(path), mode))
        return real_open(path, flags, mode, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", RecordingPopen)
    monkeypatch.setattr(os, "open", recording_open)
    RecordingPopen.lines.clear()
    try:
        assert start(repo, directory, "team") == 0
        monkeypatch.undo()
        store = store_status(directory)
        assert store is not None and RecordingPopen.lines  # weed itself is one of them
        assert not [line for line in RecordingPopen.lines if store.secret_key in line]
        # the state file and the signing keys are 0600 from their creation, not after a rename
        secret_files = [m for p, m in created if Path(p).name.startswith((f".{STATE_FILE}", ".security.toml"))]
        assert len(secret_files) == 2 and set(secret_files) == {0o600}, created
        config_local = repo / ".dvc" / "config.local"
        assert store.secret_key in config_local.read_text() and mode(config_local) == 0o600
        assert mode(directory) == 0o700
        assert "(the default remote)" in capsys.readouterr().out
    finally:
        stop_store(directory)


def test_start_keeps_a_remote_of_that_name_elsewhere(
    store_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dvc.config import Config

    store = store_status(store_dir)
    assert store is not None
    repo = dvc_repo(tmp_path / "repo")
    with Config(dvc_dir=str(repo / ".dvc")).edit("repo") as config:
        config["remote"]["team"] = {"url": "s3://their-bucket/data"}
        config["remote"]["mine"] = {"url": "s3://my-bucket/data"}
        config["core"] = {"remote": "mine"}
    with pytest.raises(EaglenestError) as refused:
        start(repo, store_dir, "team")
    assert str(refused.value) == (
        f"DVC remote 'team' of {repo} is s3://their-bucket/data: --force replaces it "
        "with this store, --name picks another name"
    )
    assert not (repo / ".dvc" / "config.local").exists()

    assert start(repo, store_dir, "team", force=True) == 0
    assert "not the default: that stays 'mine'" in capsys.readouterr().out
    config = Config(dvc_dir=str(repo / ".dvc"))
    assert config["remote"]["team"]["endpointurl"] == store.endpoint and config["core"]["remote"] == "mine"

    # the same store again: only the credentials change; the user's own fields of that remote stay
    with config.edit("local") as local:
        local["remote"]["team"].update(secret_access_key="stale", region="us-east-1")
    assert start(repo, store_dir, "team") == 0
    team = Config(dvc_dir=str(repo / ".dvc"))["remote"]["team"]
    assert team["secret_access_key"] == store.secret_key and team["region"] == "us-east-1"


def test_start_refuses_a_folder_open_to_others(tmp_path: Path) -> None:
    repo, directory = dvc_repo(tmp_path / "repo"), tmp_path / "shared"
    directory.mkdir()
    directory.chmod(0o755)
    with pytest.raises(EaglenestError) as refused:
        start(repo, directory, "team")
    assert str(refused.value) == (
        f"--dir {directory}: the folder is open to other users (mode 755) and holds no "
        f"store: name a new folder, or close it (`chmod 700 {directory}`)"
    )
    assert mode(directory) == 0o755 and not weeds_on(directory)


def test_a_second_start_of_one_store_is_refused_while_the_first_runs(tmp_path: Path) -> None:
    from eaglenest.core.lock import exclusive, lock_file_for

    repo, directory = dvc_repo(tmp_path / "repo"), tmp_path / "store"
    with exclusive(lock_file_for(directory), "the first start"), pytest.raises(EaglenestError) as refused:
        start(repo, directory, "team")
    assert str(refused.value).startswith(f"the store in {directory} is being written by pid {os.getpid()} ")
    assert not weeds_on(directory)


def _as_from_a_terminal() -> None:
    """SIGINT as a shell started from a terminal leaves it (default action, not blocked): a test worker's process may
    have inherited it blocked or ignored from a library run earlier in it, and a child inherits both."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sent", [signal.SIGKILL, signal.SIGINT])
def test_a_start_killed_while_weed_starts_leaves_nothing_running(tmp_path: Path, sent: signal.Signals) -> None:
    """The signal reaches the start between weed's launch and its first answer; where the start wins that race on a
    busy machine (it exits 0 before the signal lands: nothing to interrupt), the store is stopped and it runs again."""
    repo, directory = dvc_repo(tmp_path / "repo"), tmp_path / "store"
    try:
        for _ in range(5):
            starting = subprocess.Popen(
                eaglenest_remote_command("start", "--dir", directory),
                cwd=repo,
                env=project_env(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                preexec_fn=_as_from_a_terminal,
            )
            deadline = time.monotonic() + 60
            while not weeds_on(directory) and starting.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            assert weeds_on(directory), "weed never started"
            # SIGKILL as kill -9 or a closed terminal (nothing of the command runs after it), SIGINT as Ctrl-C
            starting.send_signal(sent)
            said = starting.communicate(timeout=60)[1]
            if starting.returncode != 0:
                break
            assert stop_store(directory)  # the start had finished: its store runs; stop it and try again
        else:
            pytest.fail("in 5 tries the start always finished before the signal reached it")
        if sent == signal.SIGINT:  # the start stops what it started, and says so in one line
            assert said.splitlines() == [
                f"eaglenest remote: error: the start of the store in {directory} was "
                "interrupted: it was stopped, nothing runs; start it again"
            ], said
            assert not weeds_on(directory)
        assert stop_store(directory) == (sent == signal.SIGKILL)  # the killed start's weed: recorded, stopped
        assert not weeds_on(directory)
    finally:
        for pid in weeds_on(directory):
            os.kill(pid, signal.SIGKILL)


def test_a_pull_keeps_no_altered_cache_entry(store_dir: Path, tmp_path: Path) -> None:
    import s3fs

    from eaglenest.commands.remote.transfer import CACHES_PREFIX, cache_folders, transfer

    store = store_status(store_dir)
    assert store is not None
    mine, theirs = dvc_repo(tmp_path / "mine"), dvc_repo(tmp_path / "theirs")
    for repo in (mine, theirs):
        use_store(repo, store_dir)
    # a stage run once leaves a run-cache entry; prepare's cache one entry
    (mine / "dvc.yaml").write_text(
        yaml.safe_dump({"stages": {"copy": {"cmd": "cp in.txt out.txt", "deps": ["in.txt"], "outs": ["out.txt"]}}})
    )
    (mine / "in.txt").write_text("rows\n")
    run([str(VENV_BIN / "dvc"), "repro", "-q"], mine)
    replies = cache_folders()[0]
    (mine / replies).mkdir(parents=True)
    (mine / replies / "aaa.json").write_text('["a reply"]')
    transfer(mine, "push", "team", [], [])
    fs = s3fs.S3FileSystem(
        key=store.access_key, secret=store.secret_key, client_kwargs={"endpoint_url": store.endpoint}
    )

    # a run-cache entry whose outputs were swapped in the store
    [entry] = (mine / ".dvc" / "cache" / "runs").glob("*/*/*")
    in_store = f"{store.bucket}/eaglenest/runs/{entry.parent.parent.name}/{entry.parent.name}/{entry.name}"
    fs.pipe(
        in_store, entry.read_bytes().replace(yaml.safe_load(entry.read_text())["outs"][0]["md5"].encode(), b"0" * 32)
    )
    pulled = theirs / ".dvc" / "cache" / "runs" / entry.relative_to(mine / ".dvc" / "cache" / "runs")
    with pytest.raises(EaglenestError) as refused:
        transfer(theirs, "pull", "team", [], [])
    assert str(refused.value).startswith(f"DVC's run-cache entry {pulled} does not match its name"), refused.value
    assert not pulled.exists()
    fs.pipe(in_store, entry.read_bytes())

    # prepare's entry with other bytes, then without its sha256: refused by name, nothing kept under it
    entry_in_store = f"{store.bucket}/eaglenest/{CACHES_PREFIX}/{replies.name}/aaa.json"
    fs.pipe(entry_in_store, b'["a poisoned reply"]')
    for fault in ("does not match the sha256 it was pushed with", "has no sha256 beside it"):
        with pytest.raises(EaglenestError) as refused:
            transfer(theirs, "pull", "team", [], [])
        assert str(refused.value).startswith(f"prepare's cache entry {entry_in_store} on remote 'team' "), refused.value
        assert fault in str(refused.value)
        assert not list((theirs / replies).iterdir())
        fs.rm(entry_in_store + ".sha256")
        fs.pipe(entry_in_store, b'["a reply"]')
