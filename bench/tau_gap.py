"""Where the gap between ``tau_sim`` and the decoded tau of the same split comes from.

Run in a checkout whose pipeline is up to date, with the project's interpreter::

    .venv/bin/python bench/tau_gap.py

It runs the train stage's validation forward of the trained draft (``models/draft``) over the validation rows and
records, for every draft start position of every reply, whether each TTT step's prediction matched the
verifier's. From the same predictions it computes:

* ``tau_sim``: ``1 + a0 + a0*a1 + ...`` from the conditional accuracies over every start position, as training
  reports it;
* ``tau_replayed``: the reply walked as speculative decoding walks it: a chain starts where the last one ended,
  accepts its leading correct steps (at most K), and the verifier adds one token. The same per-position
  predictions, counted per verify step instead of per position.

and prints them beside the decoded tau of the ``val`` set in ``metrics/eval/details.json``. The difference
between the first two is the sampling of start positions alone (decoding starts more chains where the draft
fails, since a failed chain advances one token and a good one K + 1); between the second and the decoded
figure, what teacher forcing on the training text does not see (the text the evaluated verifier writes, its
numerics, the prompts evaluated).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eaglenest.artifacts.draft import load_draft
from eaglenest.artifacts.verifier import load_verifier_info
from eaglenest.commands.params_file import load_params
from eaglenest.stages.train.data import load_training_data, pack_batches
from eaglenest.stages.train.model import draft_runtime
from eaglenest.stages.train.validation import tau_from_conditional


def capture_correct(model, data, batches, runtime) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    """Per packed batch: each TTT step's ``[starts]`` correctness and the reply mask of step 0's targets."""
    import speculators.models.eagle3.metrics as metrics

    original = metrics.compute_accuracy_single_step
    steps: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []

    def recording(pred_ids, target_ids, loss_mask, prev_correct):
        steps.append((pred_ids == target_ids)[0].cpu())  # [starts - k]: step k from start s predicts target s+k
        masks.append(loss_mask[0].bool().cpu())
        return original(pred_ids, target_ids, loss_mask, prev_correct)

    metrics.compute_accuracy_single_step = recording
    captured = []
    try:
        model.eval()
        with torch.no_grad(), runtime.autocast():
            for rows in batches:
                steps.clear()
                masks.clear()
                runtime.forward(model, data.batch(rows, runtime.device))
                captured.append((list(steps), masks[0]))
    finally:
        metrics.compute_accuracy_single_step = original
    return captured


def figures(captured, k: int) -> dict[str, float]:
    cond_hits, cond_total = [0] * k, [0] * k
    tokens = chains = 0
    for steps, reply in captured:
        n = len(reply)
        for start in range(n):
            if not reply[start]:
                continue
            chain_ok = True
            for j in range(k):
                if start >= len(steps[j]) or start + j >= n or not reply[start + j]:
                    break
                if chain_ok:
                    cond_total[j] += 1
                    cond_hits[j] += bool(steps[j][start])
                    chain_ok = bool(steps[j][start])
        start = 0
        while start < n:
            if not reply[start]:
                start += 1
                continue
            accepted = 0
            while (
                accepted < k
                and start + accepted < n
                and reply[start + accepted]
                and start < len(steps[accepted])
                and steps[accepted][start]
            ):
                accepted += 1
            tokens += accepted + 1
            chains += 1
            start += accepted + 1
    conditional = [h / t if t else 0.0 for h, t in zip(cond_hits, cond_total, strict=True)]
    return {
        "tau_sim": tau_from_conditional(conditional),
        "tau_replayed": tokens / chains,
        "conditional_accuracy": conditional,
        "chains": chains,
    }


def main() -> None:
    import sys

    params = load_params(sys.argv[1] if len(sys.argv) > 1 else "params.yaml")
    verifier, model_dir = load_verifier_info(Path("models/verifier"))
    runtime = draft_runtime(params.train, torch.device("cpu"))
    data = load_training_data(
        params.train,
        verifier,
        Path("data/prepared"),
        Path("data/hidden_states"),
        Path("data/vocab"),
        runtime.hs_dtype,
        model_dir=model_dir,
    )
    model = load_draft(Path("models/draft"), model_dir, verifier.trust_remote_code)
    batches = pack_batches(data.rows["val"], data.lengths, params.train.total_seq_len, params.train.seed, epoch=0)
    result = figures(capture_correct(model, data, batches, runtime), params.train.ttt_steps)
    details_file = Path("metrics/eval/details.json")
    details = json.loads(details_file.read_text()) if details_file.exists() else {"runs": {}}
    for backend, run in details["runs"].items():
        val = run["sets"].get("val")
        if val:
            result[f"decoded_{backend}"] = val["summary"]["tau"]
    result["train_json_tau_sim"] = json.loads(Path("metrics/train.json").read_text())["tau_sim"]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
