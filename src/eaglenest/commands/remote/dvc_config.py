"""The DVC remote of ``eaglenest remote``: the store made a DVC remote (:func:`configure_remote`), a DVC remote as
the repository's config defines it (:class:`DvcRemote`), and the one line a failure against it prints.

The store's remote is written to ``.dvc/config.local`` only: its endpoint is this machine's and its credentials are
secrets, so neither enters git (docs/team-remote.md: the same remote on AWS S3, GCS, MinIO or any S3 endpoint).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from eaglenest.commands.remote.store import WeedStore
from eaglenest.core.errors import EaglenestError

DEFAULT_REMOTE = "team"
# botocore's and s3fs' words in DVC's error line: the store refused the credentials, or could not be reached.
REFUSED_MARKERS = (
    "SignatureDoesNotMatch",
    "InvalidAccessKeyId",
    "AccessDenied",
    "(403)",
    "Forbidden",
    "Unable to locate credentials",
    "ExpiredToken",
    "InvalidToken",
)
UNREACHABLE_MARKERS = (
    "Could not connect to the endpoint URL",
    "Connect timeout on endpoint URL",
    "Connection was closed before we received a valid response",
)
# Each transfer's verb as the line says what it already moved: "objects already pushed stay".
PAST = {"push": "pushed", "pull": "pulled"}


def _private_file(path: Path) -> None:
    """Makes ``path`` exist with only its owner let in, before a secret is written to it."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))
    if path.stat().st_mode & 0o077:  # a config.local made before: closed to others before the secret goes in
        path.chmod(0o600)


def configure_remote(
    repo: Path, store: WeedStore, name: str = DEFAULT_REMOTE, prefix: str = "eaglenest", force: bool = False
) -> str:
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
        if (
            existing is not None
            and not force
            and (existing.get("url"), existing.get("endpointurl")) != (url, store.endpoint)
        ):
            raise EaglenestError(
                f"DVC remote {name!r} of {repo.resolve()} is {existing.get('url')}"
                + (f" at {existing['endpointurl']}" if existing.get("endpointurl") else "")
                + ": --force replaces it with this store, --name picks another name"
            )
        default = config["core"].get("remote")
        _private_file(Path(config.files["local"]))
        with config.edit("local") as local:
            # DVC trusts an S3 remote's objects by default; verify makes a pull hash what it downloads and refuse
            # an object whose bytes changed in the store
            section = {} if force else local["remote"].get(name, {})  # the user's other fields stay
            section.update(
                url=url,
                endpointurl=store.endpoint,
                access_key_id=store.access_key,
                secret_access_key=store.secret_key,
                verify=True,
            )
            local["remote"][name] = section
            if default is None:
                local.setdefault("core", {})["remote"] = name
    except ConfigError as err:
        raise EaglenestError(f"{repo / '.dvc'}: {err}") from None
    made = "the default remote" if default in (None, name) else f"not the default: that stays {default!r}"
    return f"DVC remote {name!r} = {url} in .dvc/config.local ({made})"


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
        return (
            f"remote {self.name!r} ({self.url}) does not answer at {self.endpoint or self.url}: start it "
            f"(`eaglenest remote start`) or fix its endpointurl; run the {verb} again, objects already "
            f"{PAST[verb]} stay"
        )

    def failure(self, said: str, verb: str) -> str:
        """The line for a failed ``verb`` from what DVC (or s3fs) said: this remote, and what to do."""
        if any(marker in said for marker in REFUSED_MARKERS):
            return (
                f"{self} refused the credentials in .dvc/config.local (or the AWS_* environment): fix its "
                f"access_key_id and secret_access_key there (edit the file: a secret on a command line shows in "
                f"`ps`; `eaglenest remote start` rewrites them for this machine's store), then run the {verb} "
                f"again"
            )
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
        raise EaglenestError(
            f"no DVC remote {name!r} in {repo.resolve()}: `eaglenest remote start` makes it on this "
            "machine's store, `dvc remote add` one elsewhere (docs/team-remote.md); --name picks "
            "another"
        )
    return DvcRemote(name, section["url"], section.get("endpointurl"))
