"""Typed, strict params: what every stage shares, and how a stage's sections are read and checked.

``params.yaml`` has one top-level key per stage, and ``cluster`` (where the stages run). Each stage's own section
has its schema beside the stage (``eaglenest.stages.<name>.params``) and each stage reads only the sections its
:class:`StageParams` names, so an edit to one stage's schema re-runs that stage alone. What more than one stage
reads lives here: the vLLM engine settings, the hidden-state storage settings extract writes and convert reads,
``cluster`` and its launcher. The whole file's model is assembled from every stage's in
:mod:`eaglenest.commands.params_file`.

Each section loads into a pydantic model with ``extra="forbid"`` and ``strict=True``, so an unknown key, a misspelt
key or a value of the wrong type is an error, not a silently ignored default. :func:`load_sections` collects
*every* problem of the sections it reads and raises one :class:`~eaglenest.core.errors.ParamsError` listing them
all, each naming the key, the value given and what is allowed.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from eaglenest.core.errors import ParamsError

BUILTIN_PREFIX = "builtin:"


class StrictModel(BaseModel):
    """Base for every params section: unknown keys and loose types are errors."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    # Keys of this section that moved (key -> where it went, a full key) or are gone (key -> what replaces them),
    # answered with that instead of a bare 'unknown key'.
    moved_keys: ClassVar[dict[str, str]] = {}
    removed_keys: ClassVar[dict[str, str]] = {}

    @staticmethod
    def consistency_problems(values: dict[str, Any]) -> list[str]:
        """Bad combinations of otherwise valid values, one line each; sections with such rules override this.

        A static method over plain values, so that ``parse_sections`` can also run it on a section with an
        unrelated bad value, where pydantic would stop before any model validator.
        """
        return []

    @model_validator(mode="after")
    def _consistent(self) -> StrictModel:
        problems = self.consistency_problems(self.model_dump())
        if problems:
            raise ValueError("\n".join(problems))  # one line each in the report
        return self


VllmDtype = Literal["auto", "float32", "bfloat16", "float16"]
VllmExecution = Literal["auto", "eager", "compiled"]


class VllmEngineParams(StrictModel):
    """One vLLM engine's settings: ``prepare.regenerate_vllm``, ``extract.vllm`` and ``evaluate.vllm``.

    Read only when that stage's back end is ``vllm``; the hf back ends load the verifier on one device.
    """

    dtype: VllmDtype = Field(
        default="auto",
        description="The verifier's compute dtype; 'auto' is the checkpoint's, except that an fp32 checkpoint is "
        "served in bfloat16, as a server would run it; float32 computes as the hf back end does.",
    )
    gpu_memory_utilization: float = Field(
        default=0.85,
        gt=0.0,
        le=1.0,
        description="Fraction of GPU memory vLLM may take (GPU build; the CPU build sizes its KV cache by "
        "VLLM_CPU_KVCACHE_SPACE).",
    )
    tensor_parallel_size: int = Field(
        default=1, ge=1, description="GPUs the engine spreads the verifier over, for a verifier one GPU cannot hold."
    )
    execution: VllmExecution = Field(
        default="auto",
        description="How the engine runs the models: compiled (vLLM's default: torch.compile, and CUDA graphs on "
        "GPUs) or eager; 'auto' is compiled on GPUs and eager on vLLM's CPU build, where each engine would pay "
        "its compilation at start (the CPU demo starts a dozen engines; docs/vllm.md has what compiling costs "
        "and gains there).",
    )


# The engine's keys as they were before each stage's engine got a section of its own: (old flat key, its key in the
# section). Regeneration's old keys carry a 'regenerate_' prefix besides.
_FLAT_ENGINE_KEYS = (
    ("vllm_dtype", "dtype"),
    ("gpu_memory_utilization", "gpu_memory_utilization"),
    ("tensor_parallel_size", "tensor_parallel_size"),
)


def engine_keys_moved(engine_key: str, flat_prefix: str = "") -> dict[str, str]:
    """``moved_keys`` of a section whose flat vLLM keys moved into its :class:`VllmEngineParams`.

    Args:
        engine_key: The engine's full key (``extract.vllm``).
        flat_prefix: What the section's old flat keys began with (``regenerate_`` for
            ``regenerate_vllm_dtype``); none for most.

    Returns:
        Each old key, mapped to the full key it became (``vllm_dtype`` -> ``extract.vllm.dtype``).
    """
    return {flat_prefix + old: f"{engine_key}.{new}" for old, new in _FLAT_ENGINE_KEYS}


def width_needs_vllm(values: dict[str, Any], section: str, engine_key: str, backend_key: str) -> list[str]:
    """A tensor-parallel width above 1 (``<section>.<engine_key>.tensor_parallel_size``) without the vllm back
    end, the only one that spreads the verifier over GPUs; the hf back end loads it on one device.

    ``values[backend_key]`` is one back end (a stage's single back end, refused only when it is hf) or a list
    (evaluate's, refused when vllm is not among them); the engine settings are a dict, a
    :class:`VllmEngineParams` or missing. Values of a wrong type are skipped.
    """
    engine = values.get(engine_key)
    if isinstance(engine, VllmEngineParams):
        engine = engine.model_dump()
    width = engine.get("tensor_parallel_size") if isinstance(engine, dict) else None
    if not (isinstance(width, int) and width > 1):
        return []
    key, backend = f"{section}.{engine_key}.tensor_parallel_size", values.get(backend_key)
    if isinstance(backend, list) and "vllm" not in backend:
        return [
            f"{key} = {width} is only used by the vllm back end, and {section}.{backend_key} is {backend}; "
            f"set it to 1 or add vllm to {section}.{backend_key}"
        ]
    if backend == "hf":
        return [
            f"{key} = {width} needs {section}.{backend_key}: vllm (the hf back end runs on one device); "
            "set it to 1 or switch the back end"
        ]
    return []


HiddenStateStore = Annotated[
    Literal["files", "online", "stream"],
    Field(
        description=(
            "'files': the hidden states of every row in data/hidden_states, in shards of extract.rows_per_shard "
            "rows (DVC-tracked, reused by every training run); 'online': nothing stored, the train stage computes "
            "each batch's hidden states from the verifier (hf back end, on train.device) and extract writes only "
            "data/hidden_states/manifest.json; 'stream': nothing stored, a pool of engines of extract.backend on "
            "cluster.executor (local: cluster.workers engine processes beside the trainer; ray: actors) computes "
            "the next batches while the trainer trains, handed to it in the plan's order (docs/scale.md: when "
            "streaming beats storing)."
        )
    ),
]
HiddenStateDtype = Annotated[
    Literal["bfloat16", "float32", "float8_e4m3fn"],
    Field(
        description=(
            "Storage dtype of the hidden-state files: bfloat16 halves float32's disk; float8_e4m3fn halves it again "
            "(one float32 scale per token, in speculators' hs_connectors FP8 layout; training dequantizes it). "
            "With store: online, the precision computed hidden states are rounded to before training, so online "
            "trains on what files would hold."
        )
    ),
]


class HiddenStateStorage(StrictModel):
    """How the hidden states are stored: ``extract.store`` and ``extract.dtype``, what convert reads of extract.

    The extract stage's own section (``eaglenest.stages.extract.params``) declares these two keys with the same
    types; convert reads only them, so an edit to the rest of extract's schema re-runs extract alone. The
    section's other keys are extract's: its stage refuses a typo there.
    """

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    store: HiddenStateStore = "files"
    dtype: HiddenStateDtype = "bfloat16"


HOST_PORT_PATTERN = re.compile(r"^[A-Za-z0-9._-]+:([0-9]{1,5})$")


def check_endpoint(value: str) -> tuple[str, int]:
    """``HOST:PORT`` as (host, port): the one reading of a network address the project takes (a Ray cluster's
    head, a rendezvous endpoint); raises ValueError saying what is allowed."""
    match = HOST_PORT_PATTERN.match(value)
    if not match or not 1 <= int(match.group(1)) <= 65535:
        raise ValueError("must be HOST:PORT: a host name or IPv4 address, and a port in 1..65535")
    host, _, port = value.rpartition(":")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine only (``localhost``, 127.0.0.0/8, ``::1``); a name other than localhost
    may resolve to any interface, so it is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class TorchrunParams(StrictModel):
    """``cluster.torchrun:`` — how the train stage's processes are launched: torchrun's elastic launcher (c10d
    rendezvous, restarts from the last checkpoint), on this machine for ``train.nproc`` > 1 and on every node
    under ``eaglenest train-launch``.

    None of it changes what is trained: ``train.nproc`` is the global batch, and every world size these bounds
    allow divides it, each process accumulating ``train.nproc / world size`` sequences per step.
    """

    max_restarts: int = Field(
        default=3,
        ge=0,
        description="Times the launcher restarts every training process after one dies (a killed process, a lost "
        "node); each restart resumes from the last checkpoint rank 0 wrote (train.checkpoint_every). 0: the first "
        "failure ends the run, and a rerun of the stage resumes.",
    )
    min_nodes: int = Field(
        default=1,
        ge=1,
        description="eaglenest train-launch: the fewest nodes training runs on; after a node is lost the others go "
        "on while at least this many remain (torchrun --nnodes=MIN:MAX).",
    )
    max_nodes: int | None = Field(
        default=None,
        ge=1,
        description="eaglenest train-launch: the most nodes that join; null = min_nodes (a fixed number of nodes).",
    )
    nproc_per_node: int | None = Field(
        default=None,
        ge=1,
        description="eaglenest train-launch: training processes per node (one per GPU); null = train.nproc / "
        "max_nodes. Every world size from min_nodes to max_nodes times this must divide train.nproc.",
    )
    rdzv_endpoint: str | None = Field(
        default=None,
        description="eaglenest train-launch: HOST:PORT of the c10d rendezvous, on the first node (its launcher hosts "
        "it); null: give --rdzv-endpoint (scripts/cluster/train.sbatch passes the allocation's first node). A "
        "training run on one machine always uses a free port on 127.0.0.1.",
    )
    rdzv_id: str = Field(
        default="eaglenest-train",
        pattern=r"^[A-Za-z0-9._-]+$",
        description="eaglenest train-launch: the job's rendezvous id, the same on every node (letters, digits, '.', "
        "'_', '-'); --rdzv-id overrides it (scripts/cluster/train.sbatch passes the Slurm job's id).",
    )
    checkpoint_dir: str | None = Field(
        default=None,
        min_length=1,
        description="The folder of the train stage's resumable checkpoints (<folder>/<run fingerprint>/"
        "checkpoint.pt, written by rank 0, read by every process on a restart); null: .eaglenest/train-checkpoints "
        "in the checkout. On several nodes it must be storage every node mounts at this path (the checkout, when "
        "it is on a shared filesystem, or a shared scratch folder): the stage refuses one that a process cannot see.",
    )

    @field_validator("rdzv_endpoint")
    @classmethod
    def _host_and_port(cls, value: str | None) -> str | None:
        if value is not None:
            check_endpoint(value)
        return value

    @staticmethod
    def consistency_problems(values: dict[str, Any]) -> list[str]:
        """Bad combinations of otherwise valid values, one line each (values of a wrong type are skipped)."""
        low, high = values.get("min_nodes"), values.get("max_nodes")
        if isinstance(low, int) and isinstance(high, int) and high < low:
            return [
                f"cluster.torchrun.max_nodes = {high} < cluster.torchrun.min_nodes = {low}: the most nodes cannot "
                "be fewer than the fewest"
            ]
        return []

    def plan(self, nproc: int) -> tuple[int, int, int | None]:
        """(fewest nodes, most nodes, processes per node) for the global batch ``nproc``; see :func:`node_plan`."""
        return node_plan(nproc, self.min_nodes, self.max_nodes, self.nproc_per_node)


def node_plan(
    nproc: int, min_nodes: int, max_nodes: int | None, nproc_per_node: int | None
) -> tuple[int, int, int | None]:
    """(fewest nodes, most nodes, processes per node) of ``cluster.torchrun`` for the global batch ``nproc``: the
    most is the fewest when null, and processes per node default to ``nproc`` over the most nodes (None where that
    is not a whole number)."""
    most = max_nodes or min_nodes
    if nproc_per_node is None and nproc % most == 0:
        nproc_per_node = nproc // most
    return min_nodes, most, nproc_per_node


CLUSTER_ADDRESS_FORMS = "'local', 'auto' or host:port"
CLUSTER_DESCRIPTION = (
    "Where and how the stages run: this process or a Ray cluster for regeneration and extract, "
    "torchrun's elastic launcher for train (no stage's params dependency: a change re-runs "
    "nothing)."
)


class ClusterParams(StrictModel):
    """``cluster:`` — where the stages run: the row-parallel work (prepare's regeneration, extract) and the train
    stage's launcher; never what they produce.

    No stage lists this section as a params dependency in dvc.yaml: switching executors re-runs nothing, and
    both executors write the same bytes (docs/scale-out.md).
    """

    executor: Literal["local", "ray"] = Field(
        default="local",
        description="'local': one process on this machine runs every task in turn; 'ray': a pool of Ray actors, "
        "each holding one engine (an hf model or a vLLM engine), runs the tasks (extract: about 64 rows of a shard "
        "each; regeneration: one batch each), and a task of an actor that dies is run again by another.",
    )
    address: str = Field(
        default="local",
        description="executor: ray: 'local' starts a Ray cluster on this machine for the stage (on 127.0.0.1 only); "
        "'auto' joins the cluster this runs in (`ray start`, SLURM, KubeRay; or RAY_ADDRESS); host:port joins the "
        "cluster whose head listens there.",
    )
    workers: int | Literal["auto"] = Field(
        default="auto",
        description="executor: ray: engines (actors) to start; 'auto' is as many as the cluster's nodes hold: "
        "per node its GPUs // the engine's tensor_parallel_size, or on nodes without GPUs its CPUs // "
        "cluster.cpus_per_worker. executor: local with extract.store: stream: engine processes beside each "
        "training process ('auto': 1).",
    )
    cpus_per_worker: int = Field(
        default=1,
        ge=1,
        description="executor: ray: CPUs each engine reserves (its torch threads) where it runs on CPUs; an engine "
        "on GPUs reserves 1 CPU per GPU.",
    )
    max_task_retries: int = Field(
        default=3,
        ge=1,
        description="executor: ray (and a local stream's engine processes): tries per task (an actor that dies, "
        "or an error) before the stage stops, naming the task and the error; a problem of the data itself (a "
        "checked error) stops it at once. Finished tasks are kept, and the next run continues.",
    )
    output: Literal["driver", "shared"] = Field(
        default="driver",
        description="executor: ray, extract: how finished shards reach data/hidden_states. 'driver': each task's "
        "rows (about 64 of a shard) are returned through Ray to this process, which writes them into their shard "
        "(no shared filesystem needed; the head holds a task's rows in memory while it writes them). 'shared': "
        "each worker computes whole shards and writes them straight into the output's unfinished folder, which "
        "must be on a filesystem every node mounts at the same path (terabyte jobs, where shards are tens of GB).",
    )

    torchrun: TorchrunParams = Field(
        default_factory=TorchrunParams,
        description="The train stage's launcher: torchrun's elastic launcher, its restarts, node bounds, rendezvous "
        "and where checkpoints live (docs/scale-out.md).",
    )

    @staticmethod
    def consistency_problems(values: dict[str, Any]) -> list[str]:
        """The nested launcher's own combinations, also where another key of the file is bad."""
        torchrun = values.get("torchrun")
        if isinstance(torchrun, TorchrunParams):
            torchrun = torchrun.model_dump()
        return TorchrunParams.consistency_problems(torchrun) if isinstance(torchrun, dict) else []

    @field_validator("address")
    @classmethod
    def _address_form(cls, value: str) -> str:
        if value in ("local", "auto"):
            return value
        try:
            check_endpoint(value)
        except ValueError:
            raise ValueError(f"allowed: {CLUSTER_ADDRESS_FORMS} (the head's GCS port, 6379 by default)") from None
        return value

    @field_validator("workers")
    @classmethod
    def _positive_workers(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be >= 1, or 'auto'")
        return value


class StageParams(StrictModel):
    """What one stage reads of params.yaml: a field per top-level section it reads, its own and the shared ones.

    The other top-level keys are other stages' sections, so they are ignored here (the whole-file check,
    :mod:`eaglenest.commands.params_file`, refuses a typo among them); inside a section read here, an unknown key
    is an error. ``consistency_problems`` of a subclass gets the raw file and checks combinations across the
    sections it reads.
    """

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


Sections = TypeVar("Sections", bound=BaseModel)


def _parent_model(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The params model that holds the key at ``loc`` (a section, a nested section, an entry of a list)."""
    current: type[BaseModel] = model
    for part in loc[:-1]:
        if isinstance(part, int):  # an entry of a list of sections (evaluate.sets)
            continue
        field = current.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if get_origin(annotation) is list:
            annotation = get_args(annotation)[0]
        # an optional section (train.peagle: PEagleParams | None): the section's model
        models = [arg for arg in get_args(annotation) if isinstance(arg, type) and issubclass(arg, BaseModel)]
        if models:
            annotation = models[0]
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        current = annotation
    return current


def _unknown_key(model: type[BaseModel], loc: tuple[Any, ...]) -> str:
    """The line for an unknown key at ``loc``: where it moved, what replaced it, or the keys allowed there."""
    key = ".".join(str(p) for p in loc)
    parent = _parent_model(model, loc)
    name = str(loc[-1])
    moved, removed = getattr(parent, "moved_keys", {}), getattr(parent, "removed_keys", {})
    if name in moved:
        return f"{key} moved to {moved[name]}"
    if name in removed:
        return f"{key}: {removed[name]}"
    hint = f" (allowed: {', '.join(parent.model_fields)})" if parent is not None else ""
    return f"{key}: unknown key{hint}"


def section_problems(raw: dict[str, Any], model: type[BaseModel]) -> list[str]:
    """Combination problems of every section ``model`` reads, and across them, found even when other values failed
    validation.

    pydantic runs a section's cross-field check only once all its fields are valid, which would hide a
    bad combination behind an unrelated typo; this reports everything in one go.
    """
    problems = []
    for section, field in model.model_fields.items():
        section_model = field.annotation
        values = raw.get(section)
        check = getattr(section_model, "consistency_problems", None)
        if (
            check is not None
            and isinstance(values, dict)
            and isinstance(section_model, type)
            and issubclass(section_model, BaseModel)
        ):
            defaults = {
                name: f.get_default(call_default_factory=True) for name, f in section_model.model_fields.items()
            }
            problems += check({**defaults, **values})
    check = getattr(model, "consistency_problems", None)
    return problems + (check(raw) if check is not None else [])


def format_validation_error(
    err: ValidationError, source: str, model: type[BaseModel], raw: dict[str, Any] | None = None
) -> str:
    """Turns a pydantic error into one line per problem: key, value given, what is allowed."""
    lines = []
    for problem in err.errors():
        loc = tuple(problem["loc"])
        key = ".".join(str(p) for p in loc)
        value = problem.get("input")
        if problem["type"] == "extra_forbidden":
            lines.append(_unknown_key(model, loc))
            continue
        message = problem["msg"].removeprefix("Value error, ")
        if isinstance(value, dict):  # a cross-field check on a whole section names its own keys
            lines += message.splitlines()
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            # a check on a whole list of sections (evaluate.sets) names the entries itself
            lines.append(f"{key}: {message}")
        else:
            lines.append(f"{key} = {value!r}: {message}")
    lines += [problem for problem in section_problems(raw or {}, model) if problem not in lines]
    count = len(lines)
    header = f"{source}: {count} invalid params value{'s' if count > 1 else ''}"
    return header + "\n" + "\n".join(f"  - {line}" for line in lines)


def parse_sections(raw: Any, model: type[Sections], source: str = "params.yaml") -> Sections:
    """Validates the sections ``model`` reads of an already-parsed params mapping; raises ParamsError listing every
    problem."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ParamsError(f"{source}: must be a mapping of stage sections, got {type(raw).__name__}")
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        raise ParamsError(format_validation_error(err, source, model, raw)) from None


def read_params_file(path: str | Path) -> Any:
    """The parsed YAML of ``path``; a missing, unreadable or invalid file is one ParamsError naming it."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ParamsError(f"{path}: params file not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ParamsError(f"{path}: cannot read params file: {err}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ParamsError(f"{path}:{where}: not valid YAML: {problem}") from None


def load_sections(path: str | Path, model: type[Sections]) -> Sections:
    """Reads ``path`` and validates the sections ``model`` reads; every problem is reported in one ParamsError."""
    return parse_sections(read_params_file(path), model, str(path))
