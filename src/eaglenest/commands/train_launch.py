"""``eaglenest train-launch``: one node's part of a multi-node training run, on torchrun's elastic launcher.

The line is built, never hand-assembled: the train stage's script and arguments come from dvc.yaml's ``cmd``
(run in the checkout's root, as ``dvc repro`` runs it), the global batch from ``train.nproc`` and the launcher's
bounds, restarts and rendezvous from ``cluster.torchrun`` of the params file that command names. ``--print``
shows the line; without it the command checks the rendezvous endpoint and the stage's inputs, then runs that
launch in this process (:func:`eaglenest.stages.train.distributed.run_launcher`), as the train stage does for
``train.nproc`` > 1 on one machine.
"""

from __future__ import annotations

import shlex
import socket
from pathlib import Path

import yaml

from eaglenest.core.errors import EaglenestError
from eaglenest.core.params import check_endpoint, load_sections

DVC_FILE = Path("dvc.yaml")


def stage_command(dvc_file: Path = DVC_FILE) -> tuple[str, list[str]]:
    """The train stage's script and its arguments, from ``dvc_file``'s ``stages.train.cmd``
    (``python stages/train.py --params ...``)."""
    try:
        stages = yaml.safe_load(dvc_file.read_text(encoding="utf-8"))["stages"]
        cmd = stages["train"]["cmd"]
    except FileNotFoundError:
        raise EaglenestError(f"{dvc_file}: not found; run eaglenest train-launch in the checkout's root") from None
    except (yaml.YAMLError, KeyError, TypeError):
        raise EaglenestError(f"{dvc_file}: no stages.train.cmd to launch") from None
    tokens = shlex.split(" ".join(cmd) if isinstance(cmd, list) else str(cmd))
    if len(tokens) < 2 or Path(tokens[0]).name not in ("python", "python3") or not tokens[1].endswith(".py"):
        raise EaglenestError(f"{dvc_file}: stages.train.cmd is {cmd!r}, not `python SCRIPT.py ARGS` to launch")
    return tokens[1], tokens[2:]


def check_rendezvous_endpoint(endpoint: str) -> None:
    """What can be known of HOST:PORT at once, before the launcher waits on it: that the host resolves.

    (A host that resolves but does not answer is the launcher's to find: it waits for the first node's launcher,
    which may start later, and then ends in one line naming the endpoint.)
    """
    host, port = check_endpoint(endpoint)
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise EaglenestError(
            f"rendezvous endpoint {endpoint}: the host {host!r} does not resolve ({err.strerror}); "
            "give the first node's name or address"
        ) from None


def train_launch(rdzv_endpoint: str | None, rdzv_id: str | None, print_only: bool) -> int:
    """Prints or runs this node's launch of the train stage; returns the exit status.

    Args:
        rdzv_endpoint: HOST:PORT of the rendezvous; None for ``cluster.torchrun.rdzv_endpoint``.
        rdzv_id: The job's rendezvous id; None for ``cluster.torchrun.rdzv_id``.
        print_only: Print the line instead of running it.
    """
    from eaglenest.core.stage import stage_parser
    from eaglenest.stages.train import STAGE, TrainPaths, check_inputs, placed
    from eaglenest.stages.train.distributed import cluster_launch, run_launcher

    script, argv = stage_command()
    stage_args = vars(stage_parser(STAGE).parse_args(argv))
    params = load_sections(stage_args.pop("params"), STAGE.params)  # what the train stage reads
    launch = cluster_launch(params.train.nproc, params.cluster.torchrun, rdzv_endpoint, rdzv_id)
    if print_only:
        print(launch.shell_line(script, argv))
        return 0
    check_rendezvous_endpoint(launch.rdzv_endpoint)
    check_inputs(params.train, placed(params, TrainPaths(**stage_args)))
    run_launcher(launch, script, argv)
    print(
        "training finished; rank 0 wrote the draft, its metrics and curves: record them with `dvc commit train` "
        "(scripts/cluster/train.sbatch does)"
    )
    return 0
