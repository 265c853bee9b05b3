"""The pull-request report workflow: its steps after the installation, run with bash in a git + DVC repository of
two commits as a runner would run them (the posting step aside), write the report without any DVC remote."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eaglenest.commands.remote.dvc_config import configure_remote
from eaglenest.commands.remote.store import start_store, stop_store
from tests.commands.test_report import DVC_YAML, GIT_ENV, commit, eval_documents, git, init_repo, loss_curves
from tests.fixtures.pipeline import REPO

WORKFLOW = REPO / ".github" / "workflows" / "report.yml"
VENV_BIN = Path(sys.executable).parent
BASE_REF = "main"
INSTALL_STEPS = ("install",)
# what GitHub puts into the expressions the steps run with, on a pull request into main (a fork's: no secrets)
EXPRESSIONS = {"github.base_ref": BASE_REF}
REMOTE_SECRETS = (
    "EAGLENEST_REMOTE_URL",
    "EAGLENEST_REMOTE_ENDPOINT",
    "EAGLENEST_REMOTE_READONLY_ACCESS_KEY_ID",
    "EAGLENEST_REMOTE_READONLY_SECRET_ACCESS_KEY",
)
# the remote's address: no credential, so a job that runs the pull request's code may hold it
ADDRESS_SECRETS = {"EAGLENEST_REMOTE_URL", "EAGLENEST_REMOTE_ENDPOINT"}
FORK = {**EXPRESSIONS, **{f"secrets.{name}": "" for name in REMOTE_SECRETS}}
# a spread of 0 for every figure: any change outside its interval gets a verdict
ZERO_SPREAD = {
    "docs/seed-spread.json": {
        "figures": {name: {"vllm_tau": 0.0, "vllm_speedup": 0.0} for name in ("humaneval", "general")}
    }
}


@pytest.fixture(scope="module")
def workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def _steps(workflow: dict, job: str = "report") -> list[dict]:
    return workflow["jobs"][job]["steps"]


def _step(workflow: dict, step_id: str, job: str = "report") -> dict:
    (step,) = [s for s in _steps(workflow, job) if s.get("id") == step_id]
    return step


def _substitute(text: str, expressions: dict[str, str] = EXPRESSIONS) -> str:
    def value(match: re.Match[str]) -> str:
        name = match.group(1).strip()
        assert name in expressions, f"the test does not know what GitHub puts into ${{{{ {name} }}}}"
        return expressions[name]

    return re.sub(r"\$\{\{(.*?)\}\}", value, text)


def test_the_workflow_installs_on_a_stock_runner_and_posts_with_cml(workflow: dict):
    assert workflow[True] == "pull_request"  # YAML 1.1 reads the key `on` as true
    assert _step(workflow, "checkout")["with"]["fetch-depth"] == 0
    assert _step(workflow, "python")["with"]["python-version"] == "3.11"
    install = _step(workflow, "install")["run"]
    assert install == "pip install --extra-index-url https://download.pytorch.org/whl/cpu -e ."
    assert _step(workflow, "setup-cml", "post")["uses"].startswith("iterative/setup-cml@")
    post = _step(workflow, "post", "post")
    assert post["run"].startswith("cml comment update ") and post["run"].endswith(" --publish report/report.md")
    assert post["env"]["REPO_TOKEN"] == "${{ secrets.GITHUB_TOKEN }}"
    assert _steps(workflow, "post")[-1] is post and workflow["jobs"]["post"]["needs"] == "report"
    commands = "\n".join(step.get("run", "") for job in workflow["jobs"] for step in _steps(workflow, job))
    assert "dvc pull" not in commands and "make setup" not in commands and "vllm" not in commands


def _secrets(value: object) -> set[str]:
    """The secrets an expression anywhere in ``value`` (a job, a step) reads."""
    return set(re.findall(r"secrets\.([A-Za-z0-9_]+)", json.dumps(value)))


def test_every_action_is_pinned_to_a_commit(workflow: dict):
    """A tag can be moved to other code; a full commit SHA cannot. The tag stands in the comment."""
    lines = [line for line in WORKFLOW.read_text().splitlines() if line.strip().startswith(("uses:", "- uses:"))]
    uses = [step["uses"] for job in workflow["jobs"] for step in _steps(workflow, job) if "uses" in step]
    assert len(uses) == len(lines) == 5
    for action in uses:
        assert re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}", action), action
    assert all(re.search(r"@[0-9a-f]{40}  # v\d+\.\d+\.\d+$", line) for line in lines), lines


def test_the_pull_request_s_code_runs_with_no_credential_that_can_change_anything(workflow: dict):
    """The job that checks out and runs the pull request's code holds read-only credentials at most and reads the
    repository only; the job that may write (the comment) checks out and runs nothing of the repository."""
    assert workflow["permissions"] == {}
    for name, job in workflow["jobs"].items():
        checks_out = any(step.get("uses", "").startswith("actions/checkout@") for step in job["steps"])
        writes = {scope for scope, access in job.get("permissions", {}).items() if access == "write"}
        if checks_out:
            assert writes == set(), name
            assert _step(workflow, "checkout", name)["with"]["persist-credentials"] is False
            credentials = _secrets(job) - ADDRESS_SECRETS
            assert credentials and all("READONLY" in secret for secret in credentials), credentials
        else:
            assert writes == {"pull-requests"} and _secrets(job) == {"GITHUB_TOKEN"}, name
            assert "scripts/" not in json.dumps(job) and "pip install" not in json.dumps(job)
            assert workflow["jobs"][name]["if"] == "github.event.pull_request.head.repo.full_name == github.repository"


def _pull_request_checkout(path: Path) -> Path:
    """A clone as actions/checkout leaves it: the pull request's head checked out, origin/main fetched."""
    origin = init_repo(path / "origin")
    subprocess.run([str(VENV_BIN / "dvc"), "init", "-q"], cwd=origin, check=True)
    subprocess.run([str(VENV_BIN / "dvc"), "config", "core.analytics", "false"], cwd=origin, check=True)
    (origin / "scripts").mkdir()
    shutil.copy2(REPO / "scripts" / "pr_report.sh", origin / "scripts")  # the step runs the repository's script
    commit(origin, {"dvc.yaml": DVC_YAML, **eval_documents(), **loss_curves(), **ZERO_SPREAD}, "base")
    git(origin, "checkout", "-q", "-b", "feature")
    commit(origin, {**eval_documents(acceptance_scale=0.55), **loss_curves(0.9)}, "a draft that accepts less")
    checkout = path / "checkout"
    git(path, "clone", "-q", "--branch", "feature", str(origin), str(checkout))
    git(checkout, "rev-parse", "--verify", f"origin/{BASE_REF}")  # fetch-depth 0: the base branch is there
    return checkout


def _run_report_steps(workflow: dict, checkout: Path, tmp_path: Path, expressions: dict[str, str]) -> str:
    """Runs the steps after the installation (the posting step aside) as a runner would; returns report.md."""
    steps = _steps(workflow)
    installed = max(i for i, step in enumerate(steps) if step.get("id") in INSTALL_STEPS)
    chosen = [step for step in steps[installed + 1 :] if "run" in step and not step["run"].startswith("cml ")]
    assert [step["id"] for step in chosen] == ["report", "summary"]

    env = (
        dict(os.environ)
        | GIT_ENV
        | {
            "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
            "DVC_SITE_CACHE_DIR": str(tmp_path / "dvc-site-cache"),
            "DVC_NO_ANALYTICS": "1",
            "GITHUB_BASE_REF": BASE_REF,
            "MPLBACKEND": "Agg",
            "GITHUB_STEP_SUMMARY": str(tmp_path / "summary.md"),
        }
    )
    env |= {
        name: _substitute(str(value), expressions) for name, value in workflow["jobs"]["report"].get("env", {}).items()
    }
    for step in chosen:
        script = tmp_path / f"{step['id']}.sh"
        script.write_text(_substitute(step["run"], expressions))
        step_env = env | {name: _substitute(str(value), expressions) for name, value in step.get("env", {}).items()}
        # the shell GitHub runs `run:` with on Linux
        result = subprocess.run(
            ["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)],
            cwd=checkout,
            env=step_env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, f"step {step['id']}:\n{result.stdout}\n{result.stderr}"
    return (checkout / "report" / "report.md").read_text()


def test_the_report_steps_write_the_report_without_a_dvc_remote(workflow: dict, tmp_path: Path):
    checkout = _pull_request_checkout(tmp_path)
    report = _run_report_steps(workflow, checkout, tmp_path, FORK)
    assert "Read from the files git tracks" in report
    assert (tmp_path / "summary.md").read_text() == report  # what a fork's pull request shows
    assert report.startswith(f"# eaglenest report: HEAD against origin/{BASE_REF}\n")
    paired = report.split(f"## Paired comparison: HEAD against origin/{BASE_REF}\n", 1)[1].split("\n## ", 1)[0]
    for set_name in ("humaneval", "general"):
        table = paired.split(f"### {set_name}\n", 1)[1].split("\n### ", 1)[0]
        assert "| tau |" in table and "| speed-up |" in table and table.count("| worse |") == 2, table
    diff = report.split("\n## dvc metrics diff\n", 1)[1]
    assert "metrics/eval.json" in diff and "humaneval.vllm_tau" in diff, diff
    images = sorted((checkout / "report").glob("*.png"))
    assert {p.name for p in images} >= {"acceptance.png", "tau_per_category.png", "loss.png"}
    for image in images:
        assert f"]({image.name})" in report and image.stat().st_size > 5000


def test_with_the_remote_s_secrets_the_report_step_pulls_the_head_s_outputs(workflow: dict, tmp_path: Path):
    checkout = _pull_request_checkout(tmp_path)
    # the head's draft, pushed to a real store by whoever ran the pipeline
    (checkout / "models").mkdir()
    (checkout / "models" / "draft.bin").write_bytes(b"draft weights")
    subprocess.run([str(VENV_BIN / "dvc"), "add", "-q", "models/draft.bin"], cwd=checkout, check=True)
    git(checkout, "add", "-A")
    git(checkout, "commit", "-qm", "the draft")
    store_dir = tmp_path / "store"
    store = start_store(store_dir)
    try:
        configure_remote(checkout, store)
        subprocess.run([str(VENV_BIN / "dvc"), "push", "-q"], cwd=checkout, check=True)
        (checkout / ".dvc" / "config.local").unlink()  # the runner's checkout knows only the secrets
        (checkout / "models" / "draft.bin").unlink()
        subprocess.run(
            [str(VENV_BIN / "dvc"), "cache", "dir", str(tmp_path / "runner-cache")], cwd=checkout, check=True
        )
        secrets = {
            "EAGLENEST_REMOTE_URL": f"s3://{store.bucket}/eaglenest",
            "EAGLENEST_REMOTE_ENDPOINT": store.endpoint,
            "EAGLENEST_REMOTE_READONLY_ACCESS_KEY_ID": store.access_key,
            "EAGLENEST_REMOTE_READONLY_SECRET_ACCESS_KEY": store.secret_key,
        }
        report = _run_report_steps(
            workflow, checkout, tmp_path, {**EXPRESSIONS, **{f"secrets.{k}": v for k, v in secrets.items()}}
        )
    finally:
        stop_store(store_dir)
    assert (checkout / "models" / "draft.bin").read_bytes() == b"draft weights"
    assert "Read from the head's outputs pulled from the team remote." in report
    assert "humaneval.vllm_tau" in report.split("\n## dvc metrics diff\n", 1)[1]
