"""GPU check (one GPU, after `make setup VLLM=gpu`): the hf and vllm back ends agree on every job.

    bash scripts/gpu_check.sh            # or: python scripts/gpu_check.py --rows 32 --work /tmp/gpu-check

Runs the real stage scripts of this checkout (``stages/*.py``) on the default verifier
(SmolLM2-135M-Instruct) and ``--rows`` built-in chitchat conversations, each back end in its own
interpreter, and compares:

1. regeneration: ``prepare`` with ``prepare.regenerate_backend`` hf and vllm (``regenerate_vllm.dtype:
   float32``, greedy). The prepared rows, which hold the regenerated replies, must be equal token for
   token.
2. extraction: ``extract`` with ``extract.backend`` hf and vllm (bf16 compute, float32 files) on the same
   prepared rows. Per layer slot: worst cosine similarity and relative mean absolute difference, within
   bf16 tolerance.
3. evaluation: a short draft trained on the GPU, then ``evaluate`` with ``evaluate.backend`` hf and vllm
   (``evaluate.vllm.dtype: float32``) on the same prompts: tau and the per-position acceptance must agree
   within 1% (relative).

The same code runs whichever vLLM build is installed (eaglenest.core.vllm_support picks the engine arguments);
it refuses to start without a CUDA device, since the comparison is about the GPU build. Prints one line per
check and exits 0 (all pass), 1 (a check failed) or 2 (cannot run here). Budget: under 10 minutes, most of
it vLLM's start-ups.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# bf16 kernels differ between transformers and vLLM (fused norms, attention); these bound honest noise.
MIN_COSINE = 0.995
MAX_RELATIVE_DIFF = 0.03
# tau and per-position acceptance of the two evaluate back ends in float32 (relative).
MAX_EVAL_RELATIVE_DIFF = 0.01


def cannot_run_here() -> str | None:
    """Why this machine cannot run the check (no CUDA device, or no vLLM build fitting it), else None."""
    import torch

    from eaglenest.core.errors import EaglenestError
    from eaglenest.core.vllm_support import require_vllm

    if not torch.cuda.is_available():
        built_for = f"CUDA {torch.version.cuda}" if torch.version.cuda else "the CPU only"
        return (
            f"no CUDA device visible to torch {torch.__version__} (built for {built_for}); run it on a "
            "machine with an NVIDIA GPU after `make setup VLLM=gpu`. On a CPU machine, "
            "bench/vllm_vs_hf.py compares the back ends instead"
        )
    try:
        require_vllm("gpu_check")
    except EaglenestError as err:
        return str(err)
    return None


class Pipeline:
    """The stage scripts of this checkout, run in ``work`` with params.yaml plus overrides."""

    def __init__(self, work: Path, rows: int) -> None:
        import yaml

        self.work = work
        self.base = yaml.safe_load((ROOT / "params.yaml").read_text())
        # val_fraction 0.25: evaluate decodes the held-out rows' prompts, 8 of them out of 32 rows
        self.base["prepare"].update(
            max_conversations=rows, max_len=512, regenerate_max_new_tokens=64, val_fraction=0.25
        )
        # float32 files: the extraction comparison then sees only the compute's differences, not storage's
        self.base["extract"]["dtype"] = "float32"
        self.base["extract"]["rows_per_shard"] = 1  # row files: the comparison reads each row's own file
        self.base["train"].update(steps=60, eval_every=30, checkpoint_every=30, total_seq_len=2048)
        self.base["evaluate"].update(
            sets=[{"name": "val", "source": "val", "num_prompts": 8, "max_new_tokens": 64, "headline": True}]
        )

    def stage(self, name: str, tag: str, overrides: dict[str, dict[str, Any]], **paths: Path) -> dict[str, Any]:
        """Runs ``stages/<name>.py``; returns its metrics (``paths["metrics"]``) or exits on failure.

        Args:
            name: The stage.
            tag: Names this run's params file and working folder (one per back end, so that caches such
                as ``.eaglenest/regenerate-cache``, which is not keyed by back end, are never shared).
            overrides: Params sections to update.
            **paths: The stage's path options (``hidden_states`` becomes ``--hidden-states``).
        """
        import yaml

        params = json.loads(json.dumps(self.base))
        for section, values in overrides.items():
            params[section].update(values)
        cwd = self.work / f"run-{tag}"
        cwd.mkdir(parents=True, exist_ok=True)
        (cwd / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        cmd = [
            sys.executable,
            str(ROOT / "stages" / f"{name}.py"),
            "--params",
            "params.yaml",
            *[f"--{key.replace('_', '-')}={value}" for key, value in paths.items()],
        ]
        started = time.perf_counter()
        result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
        print(f"  {name} ({tag}): exit {result.returncode} in {time.perf_counter() - started:.0f} s", flush=True)
        metrics = paths.get("metrics")
        # evaluate writes its metrics before refusing a lossy run: compare what it measured all the same
        if result.returncode != 0 and not (metrics and metrics.is_file()):
            print(result.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"gpu_check: the {name} stage ({tag}) failed; its stderr is above")
        return json.loads(metrics.read_text()) if metrics else {}


def compare_prepared(dir_a: Path, dir_b: Path) -> tuple[int, int]:
    """(rows whose token ids differ, rows) of two prepared datasets."""
    from datasets import load_from_disk

    a = load_from_disk(str(dir_a)).data.column("input_ids").to_pylist()
    b = load_from_disk(str(dir_b)).data.column("input_ids").to_pylist()
    if len(a) != len(b):
        return max(len(a), len(b)), max(len(a), len(b))
    return sum(x != y for x, y in zip(a, b, strict=True)), len(a)


def compare_hidden_states(dir_a: Path, dir_b: Path, rows: int, layer_ids: list[int]) -> list[dict[str, Any]]:
    """Per layer slot: worst cosine similarity over rows, and mean |a-b| / mean |a|."""
    import torch
    from safetensors.torch import load_file

    from eaglenest.artifacts.hidden_states.format import hs_path

    results = []
    for slot, layer in enumerate(layer_ids):
        cosines, diffs, scales = [], 0.0, 0.0
        for row in range(rows):
            a = load_file(hs_path(dir_a, row))["hidden_states"][:, slot].float()
            b = load_file(hs_path(dir_b, row))["hidden_states"][:, slot].float()
            cosines.append(torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item())
            diffs += (a - b).abs().mean().item()
            scales += a.abs().mean().item()
        results.append({"layer": layer, "min_cosine": min(cosines), "relative_diff": diffs / scales})
    return results


def relative_gap(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-9)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32, help="chitchat conversations to prepare")
    parser.add_argument("--work", type=Path, default=Path("/tmp/eaglenest-gpu-check"))
    args = parser.parse_args()
    reason = cannot_run_here()
    if reason:
        print(f"gpu_check: cannot run here: {reason}", file=sys.stderr)
        return 2
    from eaglenest.artifacts.verifier import load_verifier_info

    started = time.perf_counter()
    work = args.work.resolve()
    pipe = Pipeline(work, args.rows)
    verifier = work / "verifier"
    pipe.stage("verifier", "verifier", {}, out=verifier)
    failed = False

    # 1. regeneration: the prepared rows carry the regenerated replies
    prepared = {}
    for backend in ("hf", "vllm"):
        prepared[backend] = work / f"prepared-{backend}"
        pipe.stage(
            "prepare",
            f"prepare-{backend}",
            {"prepare": {"regenerate_backend": backend, "regenerate_vllm": {"dtype": "float32"}}},
            verifier=verifier,
            out=prepared[backend],
            metrics=work / f"prepare-{backend}.json",
        )
    differing, rows = compare_prepared(prepared["hf"], prepared["vllm"])
    failed |= differing > 0
    print(
        f"regeneration (float32, greedy): {rows - differing} / {rows} prepared rows equal token for token "
        f"{'ok' if differing == 0 else 'FAIL'}",
        flush=True,
    )

    # 2. extraction, on the hf back end's prepared rows
    hidden = {}
    for backend in ("hf", "vllm"):
        hidden[backend] = work / f"hs-{backend}"
        pipe.stage(
            "extract",
            f"extract-{backend}",
            {
                "extract": {
                    "backend": backend,
                    "vllm": {"dtype": "bfloat16"},
                    "device": "cuda" if backend == "hf" else "auto",
                }
            },
            verifier=verifier,
            prepared=prepared["hf"],
            out=hidden[backend],
            metrics=work / f"extract-{backend}.json",
        )
    info, _ = load_verifier_info(verifier)
    for result in compare_hidden_states(hidden["hf"], hidden["vllm"], rows, info.layer_ids):
        ok = result["min_cosine"] >= MIN_COSINE and result["relative_diff"] <= MAX_RELATIVE_DIFF
        failed |= not ok
        print(
            f"extraction layer {result['layer']:>3}: min cosine {result['min_cosine']:.5f}, "
            f"relative mean abs diff {result['relative_diff']:.4f} {'ok' if ok else 'FAIL'}",
            flush=True,
        )

    # 3. evaluation of a short draft trained on the GPU
    pipe.stage(
        "convert",
        "convert",
        {},
        verifier=verifier,
        prepared=prepared["hf"],
        hidden_states=hidden["hf"],
        out=work / "vocab",
        metrics=work / "data.json",
    )
    pipe.stage(
        "train",
        "train",
        {},
        verifier=verifier,
        prepared=prepared["hf"],
        hidden_states=hidden["hf"],
        vocab=work / "vocab",
        out=work / "draft",
        metrics=work / "train.json",
        details=work / "train_details.json",
        live_dir=work / "live",
    )
    evals = {}
    for backend in ("hf", "vllm"):
        pipe.stage(
            "evaluate",
            f"evaluate-{backend}",
            {"evaluate": {"backend": backend, "vllm": {"dtype": "float32"}}},
            verifier=verifier,
            prepared=prepared["hf"],
            draft=work / "draft",
            metrics=work / f"eval-{backend}.json",
            out=work / f"eval-{backend}",
        )
        details = json.loads((work / f"eval-{backend}" / "details.json").read_text())
        summary = details["runs"][backend]["sets"]["val"]["summary"]
        evals[backend] = {"tau": summary["tau"]["value"], "per_position_acceptance": summary["per_position_acceptance"]}
        print(f"  evaluate {backend}: {json.dumps(evals[backend])}", flush=True)
    hf, vllm = evals["hf"], evals["vllm"]
    gaps = [relative_gap(hf["tau"], vllm["tau"])] + [
        relative_gap(a, b) for a, b in zip(hf["per_position_acceptance"], vllm["per_position_acceptance"], strict=True)
    ]
    ok = max(gaps) <= MAX_EVAL_RELATIVE_DIFF
    failed |= not ok
    print(
        f"evaluation (float32): tau hf {hf['tau']} vllm {vllm['tau']}; acceptance hf "
        f"{hf['per_position_acceptance']} vllm {vllm['per_position_acceptance']}; largest relative gap "
        f"{max(gaps):.4f} {'ok' if ok else 'FAIL'}",
        flush=True,
    )
    print(f"gpu_check: {'FAIL' if failed else 'PASS'} in {time.perf_counter() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
