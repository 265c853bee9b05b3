"""The train stage: an EAGLE-3 draft with speculators' model, loss and data classes, and our own loop.

The loop is ours so that it runs on a CPU as well as a GPU: device picked automatically, fp32 on CPU and
bf16 autocast on GPU, ``sdpa`` draft attention and the eager loss on CPU (speculators' fused losses need
Triton). Data comes through speculators' ``ArrowDataset`` + ``FileTransfer`` over ``data/hidden_states``
and its ``CollateFn``, which packs rows into one ``[1, total_seq_len]`` sequence per step, after
speculators' ``shift_batch``: position t pairs the verifier's aux hidden states g_t with the *next* token
x_{t+1}, and the target is the verifier's distribution at t+1 — the draft predicts x_{t+2}, as it will when
serving.

Resume: every ``train.checkpoint_every`` steps the model, optimizer, scheduler, RNG state and step are
saved under ``.eaglenest/train-checkpoints/<fingerprint>/``, outside DVC's outputs (DVC deletes those
before re-running a stage). The fingerprint covers the train params and the hashes of the verifier,
prepared data, hidden states and vocabulary, so a changed learning rate never resumes a stale run. The
data order is a pure function of (seed, epoch), so a resumed run sees exactly the batches the
uninterrupted one would have.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eaglenest.atomic import atomic_directory, atomic_write_json, temp_sibling
from eaglenest.convert import ROWS_FILE, load_vocab
from eaglenest.errors import EaglenestError
from eaglenest.extract_hf import pick_device
from eaglenest.params import TrainParams
from eaglenest.prepare import load_split
from eaglenest.verifier import VerifierInfo, load_verifier_info

log = logging.getLogger(__name__)

CHECKPOINT_ROOT = Path(".eaglenest") / "train-checkpoints"
CHECKPOINT_FILE = "checkpoint.pt"


@dataclass(frozen=True)
class TrainInputs:
    """Paths of the train stage's inputs and outputs (from dvc.yaml)."""

    verifier: Path
    prepared: Path
    hidden_states: Path
    vocab: Path
    out: Path
    metrics: Path
    live_dir: Path
    checkpoints: Path = CHECKPOINT_ROOT


def tau_from_conditional(cond_acc: list[float]) -> float:
    """Simulated acceptance length: 1 + a0 + a0*a1 + ... (a_i = P(step i right | steps before right))."""
    tau, prefix = 1.0, 1.0
    for accuracy in cond_acc:
        prefix *= accuracy
        tau += prefix
    return tau


def build_draft(verifier: VerifierInfo, model_dir: Path, params: TrainParams, draft_vocab_size: int,
                d2t: torch.Tensor | None, t2d: torch.Tensor | None, attention: str) -> Any:
    """speculators' Eagle3DraftModel for this verifier, with its embedding, LM head and norm frozen."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    layer_config = create_transformer_layer_config(
        str(model_dir), num_layers=params.num_layers, draft_arch="llama", hidden_act=None,
        sliding_window=verifier.max_position_embeddings or 4096,
        full_attention_indices=list(range(params.num_layers)),  # plain causal attention, as vLLM serves it
        trust_remote_code=verifier.trust_remote_code,
    )
    torch.manual_seed(params.seed)
    return Eagle3DraftModel.from_training_args(
        verifier_config=layer_config, t2d=t2d, d2t=d2t, draft_vocab_size=draft_vocab_size,
        norm_before_residual=params.norm_before_residual, ttt_steps=params.ttt_steps,
        verifier_name_or_path=str(model_dir), target_layer_ids=list(verifier.aux_layers),
        draft_attn_impl=attention, trust_remote_code=verifier.trust_remote_code,
    )


def pack_batches(rows: list[int], lengths: list[int], total_seq_len: int, seed: int, epoch: int) -> list[list[int]]:
    """Rows shuffled by (seed, epoch) and packed greedily into batches of at most total_seq_len tokens."""
    order = list(rows)
    random.Random(f"{seed}:{epoch}").shuffle(order)
    batches: list[list[int]] = []
    current: list[int] = []
    used = 0
    for row in order:
        if current and used + lengths[row] > total_seq_len:
            batches.append(current)
            current, used = [], 0
        current.append(row)
        used += lengths[row]
    if current:
        batches.append(current)
    return batches


class PackedBatches:
    """Step -> batch of row indices, deterministic in (seed, epoch), so a resumed run continues exactly."""

    def __init__(self, rows: list[int], lengths: list[int], total_seq_len: int, seed: int) -> None:
        self.rows, self.lengths, self.total_seq_len, self.seed = rows, lengths, total_seq_len, seed

    def from_step(self, step: int) -> Iterator[list[int]]:
        epoch = 0
        while True:
            batches = pack_batches(self.rows, self.lengths, self.total_seq_len, self.seed, epoch)
            for batch in batches:
                if step > 0:
                    step -= 1
                    continue
                yield batch
            epoch += 1


def _hash_files(paths: list[Path], digest: Any, full: bool) -> None:
    for path in sorted(paths):
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}".encode())
        if full:
            digest.update(path.read_bytes())
        else:
            with open(path, "rb") as fh:
                digest.update(fh.read(4096))  # the safetensors header (shapes, eaglenest config)


def run_fingerprint(params: TrainParams, verifier: VerifierInfo, inputs: TrainInputs) -> str:
    """Identifies a training run: params and the content of every input."""
    digest = hashlib.sha256(params.model_dump_json().encode())
    digest.update(verifier.model_dump_json().encode())
    _hash_files([p for p in inputs.prepared.iterdir() if p.is_file()], digest, full=True)
    _hash_files([p for p in inputs.vocab.iterdir() if p.is_file()], digest, full=True)
    _hash_files(list(inputs.hidden_states.glob("hs_*.safetensors")), digest, full=False)
    return digest.hexdigest()[:24]


@dataclass(frozen=True)
class Distributed:
    """This process's place in a torchrun job (rank 0 of 1 when not distributed)."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()

    def mean(self, value: float) -> float:
        """The mean of ``value`` over all processes."""
        return self.sum(value) / self.world_size

    def sum(self, value: float) -> float:
        """The sum of ``value`` over all processes."""
        if self.world_size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.float64)
        torch.distributed.all_reduce(tensor)
        return float(tensor.item())


def init_distributed(device: torch.device) -> tuple[Distributed, torch.device]:
    """Joins the torchrun job if there is one (gloo on CPU, NCCL on GPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return Distributed(), device
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return Distributed(torch.distributed.get_rank(), world_size), device


def relaunch_with_torchrun(nproc: int, script: str, argv: list[str]) -> int:
    """Runs ``script argv`` under torchrun with ``nproc`` processes on this machine; returns its exit code."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               script, *argv]
    log.info("starting %d training processes: %s", nproc, " ".join(command))
    return subprocess.call(command)


def _to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _lr_lambda(params: TrainParams):
    def factor(step: int) -> float:
        if step < params.warmup_steps:
            return (step + 1) / params.warmup_steps
        progress = (step - params.warmup_steps) / max(1, params.steps - params.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return params.min_lr_ratio + (1 - params.min_lr_ratio) * cosine

    return factor


def evaluate_draft(model: Any, dataset: Any, collate: Any, batches: list[list[int]], device: torch.device,
                   forward_kwargs: dict[str, Any], ttt_steps: int, autocast: Any) -> dict[str, Any]:
    """Validation loss and per-TTT-step full / conditional accuracy over ``batches``; tau_sim from them."""
    sums: dict[str, float] = {}
    losses = []
    model.eval()
    with torch.no_grad(), autocast():
        for batch_rows in batches:
            batch = _to_device(collate([dataset[i] for i in batch_rows]), device)
            _, loss, metrics = model(**batch, **forward_kwargs)
            losses.append(loss.item())
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value)
    model.train()
    full = [sums[f"full_acc_{i}_sum"] / max(sums[f"full_acc_{i}_total"], 1) for i in range(ttt_steps)]
    cond = [sums[f"cond_acc_{i}_sum"] / max(sums[f"cond_acc_{i}_total"], 1) for i in range(ttt_steps)]
    return {"val_loss": sum(losses) / len(losses), "val_acc": full, "val_cond_acc": cond,
            "tau_sim": tau_from_conditional(cond)}


def _trim_live_history(live_dir: Path, start_step: int) -> None:
    """On resume, drop dvclive rows logged after the checkpoint (they are about to be logged again)."""
    for tsv in live_dir.glob("plots/metrics/**/*.tsv"):
        lines = tsv.read_text().splitlines()
        kept = [lines[0]] + [line for line in lines[1:] if int(line.split("\t")[0]) <= start_step]
        tsv.write_text("\n".join(kept) + "\n")


def train_draft(params: TrainParams, inputs: TrainInputs) -> dict[str, Any]:
    """The train stage; returns the metrics it writes."""
    from datasets import load_from_disk
    from hs_connectors import FileTransfer
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn

    from dvclive import Live

    verifier, model_dir = load_verifier_info(inputs.verifier)
    vocab, d2t, t2d = load_vocab(inputs.vocab)
    rows = json.loads((inputs.vocab / ROWS_FILE).read_text())
    lengths = load_from_disk(str(inputs.prepared)).data.column("seq_len").to_pylist()
    too_long = [row for row in rows["train"] + rows["val"] if lengths[row] > params.total_seq_len]
    if too_long:
        raise EaglenestError(
            f"train.total_seq_len = {params.total_seq_len} is shorter than prepared row {too_long[0]} "
            f"({lengths[too_long[0]]} tokens; {len(too_long)} rows in all); raise it to at least "
            f"{max(lengths)} or lower prepare.max_len"
        )
    dist, device = init_distributed(pick_device(params.device))
    attention = params.attention if params.attention != "auto" else (
        "simple_flex_attention" if device.type == "cuda" else "sdpa")
    loss_config = resolve_loss_config(params.loss, "fused" if device.type == "cuda" else "eager")
    forward_kwargs = {"ttt_steps": params.ttt_steps, "ttt_step_loss_decay": params.ttt_step_loss_decay,
                      "loss_config": loss_config}
    hs_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast(
            "cpu", enabled=False)

    split = load_split(inputs.prepared)
    # One dataset over all rows (row i is file hs_i); train/val come from convert's row lists.
    dataset = ArrowDataset(max_len=params.total_seq_len, datapath=inputs.prepared,
                           transfer=FileTransfer(inputs.hidden_states), on_missing="raise",
                           hidden_states_dtype=hs_dtype)
    collate = CollateFn(max_len=params.total_seq_len, hidden_size=verifier.hidden_size,
                        num_target_layers=len(verifier.aux_layers), dtype=hs_dtype, preprocess=shift_batch)
    model = build_draft(verifier, model_dir, params, vocab["draft_vocab_size"], d2t, t2d, attention).to(device)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=params.lr, weight_decay=params.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(params))

    fingerprint = run_fingerprint(params, verifier, inputs)
    checkpoint_path = inputs.checkpoints / fingerprint / CHECKPOINT_FILE
    start_step = _resume(checkpoint_path, model, optimizer, scheduler, params.seed)
    if dist.is_main:
        if start_step:
            log.info("resuming run %s from step %d (%s)", fingerprint, start_step, checkpoint_path)
            _trim_live_history(inputs.live_dir, start_step)
        elif inputs.live_dir.exists():
            shutil.rmtree(inputs.live_dir)
    dist.barrier()
    # Each process packs its own share of the rows; the global batch is world_size packed sequences.
    val_batches = pack_batches(rows["val"], lengths, params.total_seq_len, params.seed, epoch=0)
    my_rows = rows["train"][dist.rank :: dist.world_size]
    train_batches = PackedBatches(my_rows, lengths, params.total_seq_len, params.seed).from_step(start_step)
    network = (torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda"
                                                         else None) if dist.world_size > 1 else model)

    # dvclive step s holds what was measured after s optimizer steps (step 0: the untrained draft).
    live = (Live(dir=str(inputs.live_dir), dvcyaml=False, save_dvc_exp=False, resume=start_step > 0, report=None)
            if dist.is_main else None)

    def validate(step: int) -> dict[str, Any]:
        """Rank 0 validates on the unwrapped model (no collectives); the others wait."""
        result: dict[str, Any] = {}
        if live is not None:
            result = evaluate_draft(model, dataset, collate, val_batches, device, forward_kwargs,
                                    params.ttt_steps, autocast)
            live.step = step
            live.log_metric("val/loss", result["val_loss"])
            for i, (full, cond) in enumerate(zip(result["val_acc"], result["val_cond_acc"], strict=True)):
                live.log_metric(f"val/acc_{i}", full)
                live.log_metric(f"val/cond_acc_{i}", cond)
            live.log_metric("val/tau_sim", result["tau_sim"])
            log.info("step %d: val loss %.4f, acc %s, tau_sim %.3f", step, result["val_loss"],
                     [round(a, 3) for a in result["val_acc"]], result["tau_sim"])
        dist.barrier()
        return result

    if start_step == 0:  # the curves start at the untrained draft, so progress shows
        validate(0)
    started = time.perf_counter()
    step_seconds = 0.0  # time in training steps only, validation and checkpoints excluded
    trained_tokens = 0.0
    train_loss = float("nan")
    evaluation: dict[str, Any] = {}
    for step in range(start_step, params.steps):
        step_started = time.perf_counter()
        batch_rows = next(train_batches)
        batch = _to_device(collate([dataset[i] for i in batch_rows]), device)
        try:
            with autocast():
                _, loss, _ = network(**batch, **forward_kwargs)
            loss.backward()  # DDP averages the gradients over processes here
        except (torch.OutOfMemoryError, MemoryError):
            raise EaglenestError(
                f"out of memory on {device} for a batch of {params.total_seq_len} tokens x {params.ttt_steps} "
                f"TTT steps; lower train.total_seq_len or train.ttt_steps"
            ) from None
        if params.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(trainable, params.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        done = step + 1
        step_seconds += time.perf_counter() - step_started
        tokens = dist.sum(sum(lengths[r] for r in batch_rows))
        trained_tokens += tokens
        train_loss = dist.mean(loss.item())
        if not math.isfinite(train_loss):
            raise EaglenestError(f"training loss became {train_loss} at step {done}; lower train.lr ({params.lr})")
        if live is not None:
            live.step = done
            live.log_metric("train/loss", train_loss)
            live.log_metric("train/lr", scheduler.get_last_lr()[0])
            live.log_metric("train/tokens_per_s", tokens / (time.perf_counter() - step_started))
        if done % params.eval_every == 0 or done == params.steps:
            evaluation = validate(done)
        if done % params.checkpoint_every == 0 and done < params.steps:
            if dist.is_main:
                _save_checkpoint(checkpoint_path, model, optimizer, scheduler, done)
            dist.barrier()
    seconds = time.perf_counter() - started

    metrics: dict[str, Any] = {}
    if live is not None:
        live.end()
        save_draft(model, inputs.out, params.verifier_name or verifier.name)
        metrics = {
            "steps": params.steps,
            "steps_this_run": params.steps - start_step,
            "resumed_from_step": start_step,
            "train_loss": round(train_loss, 6),
            "val_loss": round(evaluation["val_loss"], 6),
            "val_acc": [round(a, 6) for a in evaluation["val_acc"]],
            "val_cond_acc": [round(a, 6) for a in evaluation["val_cond_acc"]],
            # The same per TTT step under flat names: `dvc metrics diff` shows scalars only.
            **{f"val_acc_{i}": round(a, 6) for i, a in enumerate(evaluation["val_acc"])},
            "tau_sim": round(evaluation["tau_sim"], 4),
            # Real (unpadded) tokens per second of training steps; validation time is not counted.
            "tokens_per_s": round(trained_tokens / step_seconds, 1) if trained_tokens else None,
            "seconds": round(seconds, 3),
            "device": device.type,
            "processes": dist.world_size,
            "train_rows": len(rows["train"]),
            "val_rows": len(rows["val"]),
            "split_train_rows": split["train_rows"],
        }
        atomic_write_json(inputs.metrics, metrics)
        shutil.rmtree(checkpoint_path.parent, ignore_errors=True)  # finished: the draft itself is the result
    dist.barrier()
    return metrics


def _resume(checkpoint_path: Path, model: Any, optimizer: Any, scheduler: Any, seed: int) -> int:
    """Loads a checkpoint if this run has one; returns the step to continue from (0: a fresh start)."""
    torch.manual_seed(seed)
    if not checkpoint_path.is_file():
        return 0
    state = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])


def _save_checkpoint(path: Path, model: Any, optimizer: Any, scheduler: Any, step: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "rng": torch.get_rng_state(), "step": step}, tmp)
    tmp.replace(path)


def save_draft(model: Any, out_dir: Path, verifier_name: str) -> None:
    """Writes the speculators checkpoint; the recorded verifier is the name a server knows, not a local path."""
    model.config.speculators_config.verifier.name_or_path = verifier_name
    with atomic_directory(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
