"""Where eaglenest keeps its own state: ``.eaglenest/`` of the checkout the pipeline was started from.

Stages keep what is no DVC output under ``.eaglenest/`` (ignored by git): the verifier's weight hashes, prepare's
regeneration and prompt caches, the train stage's resumable checkpoints. They name it relative to the working
directory, which is the checkout under ``dvc repro`` and ``dvc exp run``. A queued experiment (``dvc exp run
--queue`` run by ``dvc queue start``, or ``dvc exp run --temp``) runs instead in a temporary copy of the checkout,
``.dvc/tmp/exps/<tmp>/``, made from git, so it holds none of that state and DVC deletes it, with whatever was
written there, when the experiment ends. There the caches would start empty (a queued experiment on a prepare
param would regenerate every reply again) and a killed training run would leave no checkpoint to resume from.
So inside such a copy :func:`checkout_path` puts the state where it would be in the checkout itself, which DVC
names in ``DVC_ROOT``. Every entry there is keyed by what made it (cache entries by their inputs, a checkpoint by
the run's fingerprint of its params and inputs), so experiments share only what is the same for them.
"""

from __future__ import annotations

import os
from pathlib import Path

# DVC's folder of experiment copies, under the checkout (dvc.repo.experiments.utils.EXEC_TMP_DIR in .dvc/tmp).
EXPERIMENT_COPIES = Path(".dvc") / "tmp" / "exps"


def checkout_path(path: Path) -> Path:
    """``path`` (relative to the working directory) as the checkout sees it, also from a queued experiment's copy.

    Args:
        path: A path relative to the stage's working directory (absolute paths are returned as they are).

    Returns:
        ``path`` itself, except when this process runs in a DVC experiment's temporary copy of the checkout
        (``$DVC_ROOT/.dvc/tmp/exps/<tmp>/...``): then the same path under ``$DVC_ROOT``, the checkout the
        experiment was queued from.
    """
    root = os.environ.get("DVC_ROOT")
    if not root or path.is_absolute():
        return path
    checkout = Path(os.path.realpath(root))
    try:
        inside = Path(os.path.realpath(Path.cwd())).relative_to(checkout / EXPERIMENT_COPIES)
    except ValueError:
        return path  # the checkout itself (dvc repro, dvc exp run), or no DVC at all
    # inside = <the copy's folder>/<the stage's folder in it>: the same folder in the checkout
    return checkout.joinpath(*inside.parts[1:]) / path
