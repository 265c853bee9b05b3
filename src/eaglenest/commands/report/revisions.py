"""Reading revisions: a git revision, a DVC experiment or the workspace, and the files the report reads there.

Everything is read at each revision with ``git show`` from files git tracks (the declared metrics, the evaluate
stage's records and details: ``cache: false``); dvclive's curves and the stages' bookkeeping metrics are cached DVC
outputs, read at a revision from the DVC cache or, where it lacks them, the default remote.
"""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path
from typing import Any

import yaml

from eaglenest.artifacts.evaluation import load_records
from eaglenest.core.errors import EaglenestError, InputFileError

WORKSPACE = "workspace"
EVAL_METRICS = "metrics/eval.json"
RECORDS = "metrics/eval/records.json"
DETAILS = "metrics/eval/details.json"
SEED_SPREAD = "docs/seed-spread.json"
log = logging.getLogger(__name__)


class Revision:
    """Reads files of one revision of the repository (or the workspace).

    Attributes:
        repo: The repository.
        rev: The name it was given.
        ref: What ``git show`` reads (a commit-ish or an experiment's ref); None for the workspace.
        identity: The commit it resolves to, or ``workspace``: two names with one identity are one revision.
    """

    def __init__(self, repo: Path, rev: str) -> None:
        self.repo, self.rev = repo, rev
        self._outputs: Any = None  # the revision's DVC outputs (a DVCFileSystem), opened on the first need
        self.ref = None if rev == WORKSPACE else self._resolve(rev)
        self.identity = WORKSPACE
        if self.ref is not None:
            self.identity = self._git("rev-parse", f"{self.ref}^{{commit}}").stdout.strip()

    def _git(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], cwd=self.repo, capture_output=True, text=True)

    def _resolve(self, rev: str) -> str:
        if self._git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").returncode == 0:
            return rev
        refs = self._git("for-each-ref", "--format=%(refname)", "refs/exps").stdout.split()
        matches = [ref for ref in refs if ref.rsplit("/", 1)[-1] == rev]
        if len(matches) == 1:
            return matches[0]
        raise EaglenestError(f"revision {rev!r}: not a git revision, DVC experiment or 'workspace'")

    @property
    def short(self) -> str:
        """The identity as a reader quotes it (an abbreviated commit)."""
        return self.identity if self.identity == WORKSPACE else self.identity[:10]

    def read(self, path: str) -> str | None:
        """The file's text at this revision, or None where it does not exist there."""
        if self.ref is None:
            file = self.repo / path
            return file.read_text() if file.is_file() else None
        shown = self._git("show", f"{self.ref}:{path}")
        return shown.stdout if shown.returncode == 0 else self._read_output(path)

    def _read_output(self, path: str) -> str | None:
        """A file of a cached DVC output at this revision (the bookkeeping metrics and dvclive's curves leave git
        so that DVC's run-cache restores their stages): from the local cache, else the default remote; None where
        neither has it."""
        from dvc.api import DVCFileSystem
        from dvc.exceptions import DvcException

        if self._outputs is False:
            return None
        try:
            if self._outputs is None:
                self._outputs = DVCFileSystem(str(self.repo), rev=self.identity)
            return self._outputs.read_text(path) if self._outputs.isfile(path) else None
        except (DvcException, OSError) as err:  # not a DVC repository, no remote, an object missing everywhere
            if self._outputs is None:
                self._outputs = False  # asked once per revision
            log.debug("%s:%s: not read from DVC (%s)", self.rev, path, err)
            return None

    def read_json(self, path: str) -> Any:
        """The file parsed as JSON, or None where it does not exist.

        Raises:
            InputFileError: The file exists but is not JSON.
        """
        text = self.read(path)
        if text is None:
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise InputFileError(f"{self.rev}:{path}: not valid JSON: {err.msg} (line {err.lineno})") from None

    def records(self) -> dict[str, Any] | None:
        """The evaluate stage's records (a load_records document), or None where the revision has none."""
        text = self.read(RECORDS)
        return None if text is None else load_records(text, f"{self.rev}:{RECORDS}")


def distinct_revisions(revisions: list[Revision]) -> list[tuple[str, Revision]]:
    """One (label, revision) per identity: names of one commit (or the workspace twice) share a label ``a = b``."""
    groups: dict[str, list[Revision]] = {}
    for revision in revisions:
        names = groups.setdefault(revision.identity, [])
        if all(known.rev != revision.rev for known in names):
            names.append(revision)
    return [(" = ".join(r.rev for r in names), names[0]) for names in groups.values()]


def flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    """Nested metrics as flat names: ``train.val_acc.0`` (lists get their index)."""
    if isinstance(value, dict):
        for key, item in value.items():
            flatten(f"{prefix}.{key}" if prefix else str(key), item, out)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            flatten(f"{prefix}.{i}", item, out)
    else:
        out[prefix] = value


def metric_files(revisions: list[Revision]) -> list[str]:
    """The metrics files the revisions' dvc.yaml declare, in stage order (a file any of them declares counts)."""
    files: list[str] = []
    for revision in revisions:
        text = revision.read("dvc.yaml")
        try:
            document = yaml.safe_load(text) if text else None
        except yaml.YAMLError as err:
            raise InputFileError(f"{revision.rev}:dvc.yaml: not valid YAML: {err}") from None
        stages = document.get("stages") if isinstance(document, dict) else None
        for stage in (stages or {}).values():
            for entry in stage.get("metrics", []) if isinstance(stage, dict) else []:
                path = next(iter(entry)) if isinstance(entry, dict) else entry
                if path not in files:
                    files.append(path)
    return files


def read_metrics(revision: Revision, files: list[str]) -> dict[str, Any]:
    """The revision's metrics, flattened; a file absent at the revision contributes nothing."""
    metrics: dict[str, Any] = {}
    for path in files:
        value = revision.read_json(path)
        if value is not None:
            flatten(Path(path).stem, value, metrics)
    return metrics


def load_seed_spread(revision: Revision) -> dict[str, dict[str, float]] | None:
    """``docs/seed-spread.json``'s figures at the revision: ``{set: {metric: spread}}``; None where absent.

    Raises:
        InputFileError: The file is not ``{"figures": {set: {metric: number >= 0}}}``.
    """
    document = revision.read_json(SEED_SPREAD)
    if document is None:
        return None
    where = f"{revision.rev}:{SEED_SPREAD}"
    figures = document.get("figures") if isinstance(document, dict) else None
    if not isinstance(figures, dict):
        raise InputFileError(f"{where}: expected {{'figures': {{set: {{metric: spread}}}}}}")
    for set_name, entry in figures.items():
        if not isinstance(entry, dict):
            raise InputFileError(f"{where}: figures.{set_name}: expected {{metric: spread}}")
        for metric, spread in entry.items():
            if isinstance(spread, bool) or not isinstance(spread, (int, float)) or spread < 0:
                raise InputFileError(f"{where}: figures.{set_name}.{metric} = {spread!r}: expected a number >= 0")
    return figures


def host_key(details: Any) -> str | None:
    """The host kind's key evaluate recorded in details.json; None where it recorded none."""
    host = details.get("host") if isinstance(details, dict) else None
    return host.get("key") if isinstance(host, dict) and isinstance(host.get("key"), str) else None


def headline_sets(metrics: Any) -> list[str]:
    """The set names of a metrics/eval.json (its keys that hold a set's figures)."""
    return [name for name, value in metrics.items() if isinstance(value, dict)] if isinstance(metrics, dict) else []


def headline_backend(details: Any, records: dict[str, Any]) -> str:
    """details.json's headline back end; without details, vllm where recorded (the serving back end), else the
    only back end recorded."""
    if isinstance(details, dict) and isinstance(details.get("headline_backend"), str):
        return details["headline_backend"]
    backends = list(records["runs"])
    return "vllm" if "vllm" in backends or not backends else backends[0]
