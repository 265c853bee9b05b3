"""The cluster launchers under scripts/cluster/: the SLURM script is valid bash that starts Ray on every node with
`ray symmetric-run` and one `dvc repro` on the head; the KubeRay manifests parse and hold what KubeRay and the
pipeline need."""

from __future__ import annotations

import re
import subprocess

import yaml

from eaglenest.commands.params_file import parse_params
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
    assert "ray symmetric-run --address \"$head_ip:$port\" --min-nodes \"$SLURM_JOB_NUM_NODES\"" in command
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
            env = {item["name"]: item["value"] for item in container["env"]}
            assert env["RAY_USAGE_STATS_ENABLED"] == "0" and env["HF_HUB_OFFLINE"] == "1"
            assert {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
        if kind == "RayJob":
            assert "dvc repro" in document["spec"]["entrypoint"] and document["spec"]["shutdownAfterJobFinishes"]
