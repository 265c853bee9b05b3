"""The cluster launchers under scripts/cluster/: the SLURM script is valid bash that starts Ray on every node with
`ray symmetric-run` and one `dvc repro` on the head; the KubeRay manifests parse and hold what KubeRay and the
pipeline need."""

from __future__ import annotations

import re
import stat
import subprocess
import sys
from pathlib import Path

import yaml

from eaglenest.commands.params_file import parse_params
from tests.fixtures.cluster import TokenHead, ray_free_env, token_script_env
from tests.fixtures.pipeline import REPO

CLUSTER = REPO / "scripts" / "cluster"


def test_the_slurm_script_parses_and_runs_one_dvc_repro_on_the_head():
    script = CLUSTER / "slurm.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    directives = dict(re.findall(r"^#SBATCH --([a-z-]+)=(\S+)$", text, flags=re.MULTILINE))
    assert {"nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task"} <= directives.keys()
    assert directives["ntasks-per-node"] == "1"  # one Ray node per machine
    command = " ".join(line.strip().rstrip("\\") for line in text.split("\nsrun --nodes=")[1].splitlines())
    assert 'ray symmetric-run --address "$head_ip:$port" --min-nodes "$SLURM_JOB_NUM_NODES"' in command
    assert re.search(r"-- +bash -c 'eaglenest doctor && dvc repro \"\$@\"' dvc-repro \"\$@\"$", command), command
    assert "cluster: {executor: ray, address: auto}" in text
    # the params it asks for are valid ones
    cluster = parse_params(yaml.safe_load("cluster: {executor: ray, address: auto}")).cluster
    assert (cluster.executor, cluster.address) == ("ray", "auto")


def ray_cluster_spec(document: dict) -> dict:
    return document["spec"]["rayClusterSpec"] if document["kind"] == "RayJob" else document["spec"]


def test_the_kuberay_manifests_hold_a_head_that_runs_no_engine_and_gpu_workers():
    for name, kind in (("kuberay-raycluster.yaml", "RayCluster"), ("kuberay-rayjob.yaml", "RayJob")):
        (document,) = yaml.safe_load_all((CLUSTER / name).read_text())
        assert (document["apiVersion"], document["kind"]) == ("ray.io/v1", kind), name
        spec = ray_cluster_spec(document)
        assert spec["rayVersion"] == "2.60.0"  # the Ray of pyproject.toml
        head = spec["headGroupSpec"]
        assert head["rayStartParams"]["num-cpus"] == "0"  # the driver only
        assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1"
        (workers,) = spec["workerGroupSpecs"]
        assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] >= 1
        containers = [head["template"]["spec"]["containers"][0], workers["template"]["spec"]["containers"][0]]
        assert len({container["image"] for container in containers}) == 1  # one image: the same eaglenest
        assert int(containers[1]["resources"]["limits"]["nvidia.com/gpu"]) >= 1
        for container in containers:
            env = {item["name"]: item.get("value") for item in container["env"]}
            assert env["RAY_USAGE_STATS_ENABLED"] == "0" and env["HF_HUB_OFFLINE"] == "1"
            assert {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
        if kind == "RayJob":
            assert "dvc repro" in document["spec"]["entrypoint"] and document["spec"]["shutdownAfterJobFinishes"]


# --- Ray's token authentication ----------------------------------------------------------------------------------

CLIENT = """
import sys
from ray._raylet import GcsClient
cluster_id = sys.argv[2] if len(sys.argv) > 2 else None
try:
    client = GcsClient(address=sys.argv[1], **({"cluster_id": cluster_id} if cluster_id else {}))
    client.internal_kv_keys(b"", namespace=None, timeout=5)
except Exception as err:
    print("refused:", type(err).__name__, err)
else:
    print("connected:", client.cluster_id.hex())
"""


def ask_head(head: TokenHead, env: dict[str, str], cluster_id: str = "") -> str:
    """What a Ray client in ``env`` (plus a home without a token) gets from the head: 'connected: ID' or 'refused:
    ...'. Knowing the cluster's id, a client without the token is answered at once (it would retry for 20 s)."""
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, head.address, *([cluster_id] if cluster_id else [])],
        env=ray_free_env(head.home) | env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.stdout.strip()


def test_the_slurm_script_starts_every_ray_process_with_a_token():
    text = (CLUSTER / "slurm.sbatch").read_text()
    lines = [line.strip() for line in text.splitlines() if not line.lstrip().startswith("#")]
    sourced = lines.index(
        "source scripts/cluster/ray_token.sh  # RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH: before any Ray process starts"
    )
    assert all(i > sourced for i, line in enumerate(lines) if re.search(r"\bray ", line))
    assert """trap 'rm -f "$RAY_AUTH_TOKEN_PATH"' EXIT""" in lines
    assert "--export" not in text  # srun passes the job's environment, the token's variables with it, to every node


def test_the_kuberay_pods_read_the_token_from_a_secret():
    for name in ("kuberay-raycluster.yaml", "kuberay-rayjob.yaml"):
        (document,) = yaml.safe_load_all((CLUSTER / name).read_text())
        spec = ray_cluster_spec(document)
        templates = [spec["headGroupSpec"]["template"], spec["workerGroupSpecs"][0]["template"]]
        if document["kind"] == "RayJob":
            templates.append(document["spec"]["submitterPodTemplate"])  # it talks to the dashboard, which asks too
        for template in templates:
            env = {item["name"]: item for item in template["spec"]["containers"][0]["env"]}
            assert env["RAY_AUTH_MODE"]["value"] == "token", name
            assert env["RAY_AUTH_TOKEN"]["valueFrom"] == {
                "secretKeyRef": {"name": "eaglenest-ray-token", "key": "auth_token"}
            }, name


def source_token_script(home: Path, job_id: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", 'source "$0"', str(CLUSTER / "ray_token.sh")],
        env=ray_free_env(home) | {"SLURM_JOB_ID": job_id},
        capture_output=True,
        text=True,
    )


def test_the_token_script_makes_a_private_token_for_each_job(tmp_path: Path):
    env = token_script_env(tmp_path, "42")
    token = Path(env["RAY_AUTH_TOKEN_PATH"])
    assert env["RAY_AUTH_MODE"] == "token" and token == tmp_path / ".eaglenest" / "ray-tokens" / "job-42.token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    assert re.fullmatch(r"[0-9a-f]{64}", token.read_text())
    assert token.read_text() != Path(token_script_env(tmp_path, "43")["RAY_AUTH_TOKEN_PATH"]).read_text()
    again = source_token_script(tmp_path, "42")  # never an existing file, whatever its mode
    assert again.returncode == 2 and "could not make a new token file" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
    token.parent.chmod(0o755)
    done = source_token_script(tmp_path, "44")
    assert done.returncode == 2 and "must be a folder of yours that only you can enter" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (token.parent / "job-44.token").exists()


def test_a_head_started_with_the_token_refuses_clients_without_it(token_head: TokenHead):
    answer = ask_head(token_head, token_head.token_env)
    assert answer.startswith("connected: "), answer
    cluster_id = answer.split()[-1]
    refused = ask_head(token_head, {}, cluster_id)
    assert refused.startswith("refused: AuthenticationError") and "InvalidAuthToken" in refused, refused
    wrong = ask_head(token_head, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}, cluster_id)
    assert wrong.startswith("refused: AuthenticationError"), wrong
