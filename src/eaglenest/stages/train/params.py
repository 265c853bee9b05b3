"""``train:`` in params.yaml: the train stage's params, and what the stage reads of the file (its own section and
``cluster.torchrun``, its launcher)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from eaglenest.core.params import (
    CLUSTER_DESCRIPTION,
    ClusterParams,
    StageParams,
    StrictModel,
    TorchrunParams,
    node_plan,
)


def mask_token_field(positions: str) -> Any:
    """The ``mask_token_id`` field of an algorithm that drafts positions in parallel (P-EAGLE, DFlash).

    Both fill those positions with one token, resolved the same way where the field is null
    (:func:`eaglenest.stages.train.model.mask_token_id`), so the field is declared once.

    Args:
        positions: The description's words for the positions that carry the token, verb included ("the
            drafted positions of a block carry").
    """
    return Field(
        default=None,
        ge=0,
        description=f"The token id {positions}; null: the tokenizer's mask token, else its pad, eos or unk token "
        "(speculators' resolve_mask_token_id).",
    )


class PEagleParams(StrictModel):
    """``train.peagle:`` — P-EAGLE's knobs (speculators' PEagleDraftModel); only with ``train.algorithm: peagle``."""

    down_sample_ratio: float = Field(
        default=0.7,
        gt=0.0,
        lt=1.0,
        description="COD sampling: depth d of a parallel group trains on this ratio to the power d of the "
        "positions (speculators' default).",
    )
    down_sample_ratio_min: float = Field(
        default=0.2, ge=0.0, le=1.0, description="COD sampling: the smallest share of positions any depth keeps."
    )
    max_anchors: int | None = Field(
        default=None,
        ge=1,
        description="At most this many anchor positions per packed batch; null: every position with loss.",
    )
    mask_token_id: int | None = mask_token_field("the parallel positions carry (vLLM's pard_token)")


class DFlashParams(StrictModel):
    """``train.dflash:`` — DFlash's knobs (speculators' DFlashDraftModel); only with ``train.algorithm: dflash``.

    Its block is ``train.ttt_steps`` + 1 positions: the last verified token, then K = ttt_steps drafted ones.
    """

    max_anchors: int = Field(
        default=512,
        ge=1,
        description="Blocks per packed batch, anchored at positions sampled from those with loss (speculators' "
        "default).",
    )
    decay_gamma: float = Field(
        default=4.0,
        gt=0.0,
        description="Loss weight over a block's positions, exp(-(k - 1) / gamma) at position k (speculators' "
        "dflash_decay_gamma).",
    )
    mask_token_id: int | None = mask_token_field("the drafted positions of a block carry")


class MuonParams(StrictModel):
    """``train.muon:`` — Muon's knobs (``torch.optim.Muon`` over the draft's 2-D weight matrices, as speculators'
    ``build_optimizers`` splits them); only with ``train.optimizer: muon``. The defaults are speculators'."""

    lr: float = Field(
        default=0.02,
        gt=0.0,
        le=1.0,
        description="Peak Muon learning rate (speculators' muon_lr), warmed up and decayed as train.lr is, then "
        "scaled per matrix by adjust_lr_fn.",
    )
    momentum: float = Field(default=0.95, ge=0.0, lt=1.0, description="Muon's (Nesterov) momentum.")
    weight_decay: float = Field(
        default=0.1,
        ge=0.0,
        description="Muon's decoupled weight decay on the matrices (train.weight_decay stays AdamW's, on the rest).",
    )
    ns_steps: int = Field(
        default=5,
        ge=1,
        lt=100,
        description="Newton-Schulz iterations that orthogonalize each matrix's update (torch allows fewer than 100).",
    )
    adjust_lr_fn: Literal["match_rms_adamw", "original"] = Field(
        default="match_rms_adamw",
        description="How torch scales the learning rate of an A x B matrix: match_rms_adamw (x 0.2 * sqrt(max(A, "
        "B)): the orthogonalized update gets the RMS of a typical AdamW update, Moonshot's rule) or original (x "
        "sqrt(max(1, A / B)), Keller Jordan's).",
    )


class TrainParams(StrictModel):
    """``train:`` — the draft (speculators' model class for ``algorithm``), trained on the extracted hidden
    states."""

    algorithm: Literal["eagle3", "peagle", "dflash"] = Field(
        default="eagle3",
        description="The draft algorithm, each with speculators' own model class, loss and checkpoint format, "
        "served by vLLM: eagle3 (EAGLE-3: K chained draft steps, trained with training-time test; EAGLE-3.1 "
        "with norm_before_fc and norm_output), peagle (P-EAGLE: the K tokens drafted in one forward; its "
        "embeddings train too), dflash (DFlash: a block of K + 1 positions drafted at once by Qwen3-style "
        "layers; needs draft_arch: qwen3). The hf back end's reference decoder decodes eagle3 only; evaluate "
        "measures the others through vLLM (docs/draft-architecture.md).",
    )
    peagle: PEagleParams | None = Field(
        default=None, description="P-EAGLE's knobs (only with algorithm: peagle); null: speculators' defaults."
    )
    dflash: DFlashParams | None = Field(
        default=None, description="DFlash's knobs (only with algorithm: dflash); null: speculators' defaults."
    )
    num_layers: int = Field(default=1, ge=1, description="Draft decoder layers.")
    draft_arch: Literal["auto", "llama", "qwen3"] = Field(
        default="auto",
        description="The draft's decoder layer: speculators 0.9 builds 'llama' and 'qwen3' (per-head q/k norms) "
        "layers, and vLLM serves both (Eagle3LlamaForCausalLM, Eagle3Qwen3ForCausalLM). Either fits any verifier: "
        "the draft takes the verifier's hidden size and vocabulary. 'auto' is 'qwen3' for dflash (the only layer "
        "vLLM's DFlash serves) and 'llama' otherwise. No MLA (DeepSeek-V3-style) draft layer exists in "
        "speculators 0.9 (docs/draft-architecture.md).",
    )
    ttt_steps: int = Field(
        default=2,
        ge=1,
        description="K, the tokens the draft proposes per step: eagle3's training-time-test "
        "unroll depth, peagle's parallel depths, dflash's block less its anchor. It is the draft's "
        "speculative_tokens: the K evaluate uses unless evaluate.num_speculative_tokens says otherwise, and "
        "`eaglenest serve` unless the k_sweep stage measured another K for this draft (metrics/k_sweep.json).",
    )
    ttt_step_loss_decay: float = Field(default=1.0, gt=0.0, description="Loss weight factor per TTT step.")
    total_seq_len: int = Field(
        default=512, ge=16, description="Tokens per packed training batch (rows are packed, never split)."
    )
    steps: int = Field(default=800, ge=1, description="Optimizer steps.")
    optimizer: Literal["adamw", "muon"] = Field(
        default="adamw",
        description="adamw: AdamW over every trainable weight. muon: torch's Muon over the draft layers' 2-D weight "
        "matrices (fc, attention and MLP projections) and AdamW (train.lr, train.weight_decay) over the rest "
        "(norms, and P-EAGLE's embeddings and mask vector): speculators' build_optimizers split, its knobs in "
        "train.muon (docs/training.md).",
    )
    muon: MuonParams | None = Field(
        default=None, description="Muon's knobs (only with optimizer: muon); null: speculators' defaults."
    )
    lr: float = Field(default=1e-3, gt=0.0, le=1.0, description="Peak AdamW learning rate.")
    weight_decay: float = Field(default=0.0, ge=0.0, description="AdamW weight decay.")
    warmup_steps: int = Field(default=10, ge=0, description="Linear warm-up steps before the cosine decay.")
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0, description="Cosine decay floor, as a fraction of lr.")
    grad_clip: float = Field(default=1.0, ge=0.0, description="Max gradient norm; 0 turns clipping off.")
    eval_every: int = Field(default=100, ge=1, description="Validate every this many steps (and at the end).")
    checkpoint_every: int = Field(default=100, ge=1, description="Save a resumable checkpoint every this many steps.")
    seed: int = Field(default=0, description="Seed of weights init, data order and everything random.")
    attention: Literal["auto", "sdpa", "eager", "simple_flex_attention"] = Field(
        default="auto", description="Draft attention: auto is sdpa on CPU, simple_flex_attention on GPU."
    )
    loss: str = Field(default="kl_div", min_length=1, description="speculators loss name (kl_div, ce, tv, ...).")
    loss_tokens: Literal["all", "replies"] = Field(
        default="all",
        description="Positions of a training row that carry the loss. 'replies': the assistant turns prepare marked "
        "(speculators' own loss mask). 'all': every position, prompts and system text included, but each row's first "
        "ttt_steps - 1 (TTT step k would score them against the row packed before it); the target there "
        "is still the verifier's own next-token distribution, so a prompt is more distillation signal from the "
        "same hidden states, which raised acceptance at the demo's budget (docs/defaults.md has the measurement). "
        "Validation always measures the replies.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="auto: CUDA when present.")
    precision: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto",
        description="Compute dtype of the draft's forward and backward (torch autocast; weights and optimizer "
        "state stay float32). auto: bfloat16 on CUDA and on CPUs with native bf16 arithmetic (AVX512-BF16 or "
        "AMX), float32 elsewhere; native bf16 trains faster at the same losses (docs/defaults.md has the "
        "measurement).",
    )
    nproc: int = Field(
        default=1,
        ge=1,
        description="The global batch: packed sequences of total_seq_len per optimizer step, trained data-parallel "
        "(DDP: gloo on CPU, NCCL on GPU). On one machine the stage starts this many processes under torchrun's "
        "elastic launcher when > 1 (cluster.torchrun); on several nodes (eaglenest train-launch) every world size "
        "that divides it trains the same steps, each process accumulating nproc / world size sequences, so a lost "
        "node changes nothing trained.",
    )
    norm_before_residual: bool = Field(default=True, description="Written explicitly into the draft config.")
    norm_before_fc: bool = Field(
        default=False,
        description="EAGLE-3.1: an RMSNorm over the concatenated aux hidden states before the draft's fc "
        "projection (speculators' Eagle3 option; vLLM reads it from the draft config). docs/experiments.md has "
        "the measurement that chose the default.",
    )
    norm_output: bool = Field(
        default=False,
        description="EAGLE-3.1: an RMSNorm on the draft layer's output before it is fed back as the next step's "
        "hidden state (speculators' Eagle3 option; vLLM reads it from the draft config).",
    )
    verifier_name: str | None = Field(
        default=None,
        description="Verifier name recorded in the draft (what a server is given); null uses verifier.name.",
    )

    @property
    def draft_layer(self) -> str:
        """The decoder layer speculators builds: ``draft_arch``, with 'auto' resolved for ``algorithm``."""
        if self.draft_arch != "auto":
            return self.draft_arch
        return "qwen3" if self.algorithm == "dflash" else "llama"

    @property
    def muon_settings(self) -> MuonParams:
        """Muon's knobs: ``train.muon``, or speculators' defaults where it is null."""
        return self.muon or MuonParams()

    @staticmethod
    def consistency_problems(values: dict[str, Any]) -> list[str]:
        problems = []
        optimizer = values.get("optimizer", "adamw")
        if values.get("muon") is not None and isinstance(optimizer, str) and optimizer != "muon":
            problems.append(
                f"train.muon: only with train.optimizer: muon (it is {optimizer}); remove train.muon "
                "or set train.optimizer: muon"
            )
        algorithm = values.get("algorithm", "eagle3")
        if not isinstance(algorithm, str):
            return problems  # the field's own error names the value; nothing here can be checked against it
        for section in ("peagle", "dflash"):
            if values.get(section) is not None and algorithm != section:
                problems.append(
                    f"train.{section}: only with train.algorithm: {section} (it is {algorithm}); "
                    f"remove train.{section} or set train.algorithm: {section}"
                )
        if algorithm == "dflash" and values.get("draft_arch", "auto") not in ("auto", "qwen3"):
            problems.append(
                f"train.draft_arch = {values.get('draft_arch')!r}: a dflash draft has Qwen3-style "
                "layers (what vLLM's DFlash serves); set train.draft_arch: qwen3 (or auto)"
            )
        unread = {"dflash": ("norm_before_fc", "norm_output"), "peagle": ("norm_output",)}.get(algorithm, ())
        for name in unread:
            if values.get(name):
                problems.append(
                    f"train.{name}: not an option of train.algorithm: {algorithm} (vLLM would not "
                    f"read it from the draft); set train.{name}: false"
                )
        return problems


def world_size_problems(nproc: Any, torchrun: dict[str, Any]) -> list[str]:
    """Node bounds under which some world size would not divide ``train.nproc`` (the global batch), one line.

    ``torchrun`` holds ``cluster.torchrun``'s values (defaults where missing); values of a wrong type are skipped.
    """
    values = {
        name: torchrun.get(name, TorchrunParams.model_fields[name].default)
        for name in ("min_nodes", "max_nodes", "nproc_per_node")
    }
    if not all(isinstance(value, int) and value >= 1 for value in (nproc, values["min_nodes"])) or not all(
        value is None or isinstance(value, int) and value >= 1 for value in values.values()
    ):
        return []
    low, high, per_node = node_plan(nproc, **values)
    if per_node is None:
        return [
            f"cluster.torchrun.nproc_per_node: null means train.nproc / cluster.torchrun.max_nodes = {nproc} / "
            f"{high}, not a whole number; set cluster.torchrun.nproc_per_node"
        ]
    bad = [nodes for nodes in range(low, high + 1) if nproc % (nodes * per_node)]
    if bad:
        return [
            f"train.nproc = {nproc} (the global batch, in packed sequences) is not a multiple of the world size "
            f"{bad[0] * per_node} ({bad[0]} node(s) x {per_node} processes per node) that cluster.torchrun's node "
            f"bounds {low}..{high} allow; every world size must divide it: change the bounds, "
            "cluster.torchrun.nproc_per_node or train.nproc"
        ]
    return []


class TrainStageParams(StageParams):
    """What the train stage reads of params.yaml: its own section, and ``cluster`` (``cluster.torchrun``, its
    launcher, and where its checkpoints live)."""

    train: TrainParams = Field(default_factory=TrainParams, description="The train stage.")
    cluster: ClusterParams = Field(default_factory=ClusterParams, description=CLUSTER_DESCRIPTION)

    @staticmethod
    def consistency_problems(values: dict[str, Any]) -> list[str]:
        """Combinations across the sections: the launcher's world sizes against the global batch."""
        train, cluster = values.get("train") or {}, values.get("cluster") or {}
        if not (isinstance(train, dict) and isinstance(cluster, dict)):
            return []  # a section that is not a mapping: its own error says so
        torchrun = cluster.get("torchrun") or {}
        return world_size_problems(train.get("nproc", 1), torchrun) if isinstance(torchrun, dict) else []
