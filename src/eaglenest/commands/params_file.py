"""The whole params.yaml: every stage's own section and the shared ``cluster``, assembled from a registry.

Each stage's schema lives beside the stage (``eaglenest.stages.<name>.params``) and a stage reads only its
:class:`~eaglenest.core.params.StageParams`; the checks that read the whole file (``eaglenest doctor``,
``eaglenest init``, ``train-launch``, the params reference ``docs/params.md``) use :data:`Params`, which refuses an
unknown key anywhere and runs every stage's cross-section checks. A new stage registers its own section here, and
its :class:`StageParams` in :data:`STAGE_PARAMS`.

Importing this module imports every stage's package (a stage's ``params`` module sits inside it), torch included:
commands import it where they use it, never at the top of the command line's parser.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, create_model

from eaglenest.core.params import (
    CLUSTER_DESCRIPTION,
    ClusterParams,
    StageParams,
    StrictModel,
    load_sections,
    parse_sections,
)
from eaglenest.core.registry import Registry
from eaglenest.stages.convert.params import ConvertStageParams
from eaglenest.stages.evaluate.params import EvaluateStageParams
from eaglenest.stages.extract.params import ExtractStageParams
from eaglenest.stages.free_sweep.params import FreeSweepStageParams
from eaglenest.stages.k_sweep.params import KSweepStageParams
from eaglenest.stages.plan.params import PlanStageParams
from eaglenest.stages.prepare.params import PrepareStageParams
from eaglenest.stages.train.params import TrainStageParams
from eaglenest.stages.verifier.params import VerifierStageParams


@dataclass(frozen=True)
class Section:
    """One top-level key of params.yaml.

    Attributes:
        model: The section's schema.
        description: One line: what the section is for (the params reference's).
    """

    model: type[StrictModel]
    description: str


# What each stage reads, by stage name, in pipeline order (a stage's own section is the field named as it).
STAGE_PARAMS: Registry[type[StageParams]] = Registry("stage's params")
for _name, _model in (
    ("verifier", VerifierStageParams),
    ("prepare", PrepareStageParams),
    ("extract", ExtractStageParams),
    ("convert", ConvertStageParams),
    ("train", TrainStageParams),
    ("free_sweep", FreeSweepStageParams),
    ("evaluate", EvaluateStageParams),
    ("k_sweep", KSweepStageParams),
    ("plan", PlanStageParams),
):
    STAGE_PARAMS.register(_name, _model)

# The file's top-level keys, in the order the reference and `eaglenest init` write them.
SECTIONS: Registry[Section] = Registry("params section")
for _name, _model in STAGE_PARAMS.items():
    if _name not in _model.model_fields:  # a stage without a section of its own (plan)
        continue
    _own = _model.model_fields[_name]
    SECTIONS.register(_name, Section(_own.annotation, _own.description or ""))
SECTIONS.register("cluster", Section(ClusterParams, CLUSTER_DESCRIPTION))


class ParamsFile(StrictModel):
    """Base of :data:`Params`: unknown top-level keys are errors (a stage ignores the sections it does not read),
    and every stage's checks across the sections it reads run on the whole file."""

    @staticmethod
    def consistency_problems(values: dict[str, Any]) -> list[str]:
        """Every stage's combination problems across its sections, on the raw file (one line each, no repeats)."""
        problems: list[str] = []
        for _, model in STAGE_PARAMS.items():
            problems += [problem for problem in model.consistency_problems(values) if problem not in problems]
        return problems


Params = create_model(
    "Params",
    __base__=ParamsFile,
    __doc__="The whole params.yaml: one section per stage, and ``cluster`` (where and how they run).",
    **{
        name: (section.model, Field(default_factory=section.model, description=section.description))
        for name, section in SECTIONS.items()
    },
)

# Every key of the file that moved or is gone, as a full key (what the file's check answers for it).
MOVED_KEYS = {
    f"{name}.{key}": new for name, section in SECTIONS.items() for key, new in section.model.moved_keys.items()
}


def parse_params(raw: Any, source: str = "params.yaml") -> ParamsFile:
    """Validates an already-parsed params file as a whole; raises ParamsError listing every problem."""
    return parse_sections(raw, Params, source)


def load_params(path: str | Path = "params.yaml") -> ParamsFile:
    """Reads and validates the whole params file ``path``; every problem is reported in one ParamsError."""
    return load_sections(path, Params)
