"""scripts/experiment_record.py: an experiment's record skeleton from the params, metrics and host kind that git
holds at the experiment and at its baseline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from tests.fixtures.pipeline import REPO, project_env, run
from tests.project.test_docs import check_command

sys.path.insert(0, str(REPO / "scripts"))
from experiment_record import record  # noqa: E402

HOST = {
    "cpu": "AMD EPYC 9R14",
    "aten_capability": "AVX512",
    "bf16_native": True,
    "gpu": None,
    "compute_dtype": "bfloat16",
}
SOURCES = [{"source": "builtin:self-instruct", "weight": 2}, {"source": "builtin:chitchat", "weight": 1}]


def _commit(repo: Path, lr: float, sources: list, tau: float, host: dict | None) -> str:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["train"]["lr"], params["prepare"]["source"] = lr, sources
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (repo / "metrics" / "eval").mkdir(parents=True, exist_ok=True)
    figures = {
        "vllm_tau": tau,
        "vllm_tau_ci95": 0.03,
        "vllm_speedup": 1.2,
        "vllm_speedup_ci95": 0.07,
        "vllm_vs_free": 1.1,
        "vllm_vs_free_ci95": 0.05,
    }
    (repo / "metrics" / "eval.json").write_text(json.dumps({"humaneval": figures, "lossless": 1.0}))
    details = {"num_speculative_tokens": 2, "headline_backend": "vllm", "runs": {}, **({"host": host} if host else {})}
    (repo / "metrics" / "eval" / "details.json").write_text(json.dumps(details))
    (repo / "metrics" / "train.json").write_text(json.dumps({"tau_sim": tau + 0.2}))
    (repo / "metrics" / "train_details.json").write_text(json.dumps({"seconds": 233.4}))
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", f"lr {lr}"], repo)
    return run(["git", "rev-parse", "HEAD"], repo).stdout.strip()


def _repo(tmp_path: Path) -> tuple[Path, str, str]:
    """A baseline commit and, as DVC stores one, an experiment on it (a commit under refs/exps, parent the
    baseline), which is then taken off the branch."""
    repo = tmp_path / "repo"
    repo.mkdir()
    run(["git", "init", "-q"], repo)
    baseline = _commit(repo, 0.001, SOURCES, 1.5, None)
    experiment = _commit(repo, 0.0003, [*SOURCES, {"source": "builtin:python-functions", "weight": 1}], 1.6, HOST)
    run(["git", "update-ref", f"refs/exps/{baseline[:2]}/{baseline[2:]}/lr-3e-4", experiment], repo)
    run(["git", "reset", "-q", "--hard", baseline], repo)
    return repo, baseline, experiment


def test_an_experiments_record(tmp_path: Path):
    repo, baseline, _ = _repo(tmp_path)
    text = record(repo, "lr-3e-4")
    assert text.startswith("### lr-3e-4\n")
    assert "**Change**: `prepare.source` [{source: builtin:self-instruct, weight: 2}, " in text
    assert "`train.lr` 0.001 → 0.0003 (against" in text
    command = text.split("**Command**: `")[1].split("`.")[0]
    assert command.startswith("dvc exp run -n lr-3e-4 -S 'prepare.source=[{source: builtin:self-instruct, weight: 2}, ")
    assert command.endswith(" -S train.lr=0.0003")
    assert check_command(command) is None, "the printed command must pass the params' strict check"
    assert f"**Commit**: {baseline[:7]} (the experiment's baseline" in text
    assert "**Host**: AMD EPYC 9R14, AVX512 (bf16 native), computing in bfloat16;" in text
    assert "| `humaneval` | 1.500 ± 0.030 → 1.600 ± 0.030 | x1.200 ± 0.070 → x1.200 ± 0.070 |" in text
    assert "lossless 1.0; `tau_sim` 1.700 → 1.800; stage times train 233 s" in text
    assert f"`eaglenest report {baseline[:7]} lr-3e-4`" in text
    assert text.count("_(fill in:") == 3  # the question, the host's load, the conclusion


def test_a_revision_without_a_host_record_leaves_the_host_to_fill_in(tmp_path: Path):
    repo, baseline, _ = _repo(tmp_path)
    text = record(repo, "HEAD", "HEAD", title="The baseline")
    assert text.startswith("### The baseline\n") and "**Change**: none to the params" in text
    assert f"**Commit**: {baseline[:7]}." in text
    assert "the metrics predate the host record" in text
    assert "_(fill in: what ran it:" in text


def test_an_unknown_revision_is_one_line(tmp_path: Path):
    repo, _, _ = _repo(tmp_path)
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "experiment_record.py"), "nope", "--repo", str(repo)],
        capture_output=True,
        text=True,
        env=project_env(PYTHONPATH=str(REPO / "src")),
    )
    assert result.returncode == 1
    assert result.stderr == "experiment_record.py: revision 'nope': not a git revision, DVC experiment or 'workspace'\n"
