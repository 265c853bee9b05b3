"""vLLM's own draft classes load every weight of the drafts eaglenest trains, for each ``train.algorithm``.

A draft that vLLM merely loads proves little: vLLM's default loader exempts every parameter of a module with a
quant method (every linear layer, unquantized ones too) from its "weights not initialized from checkpoint" check,
and the EAGLE-3 and DFlash classes' ``load_weights`` return nothing, which skips that check altogether. A renamed
or missing tensor then leaves a parameter at whatever it was built with (zeros for ``d2t``). So each test builds
the class vLLM's speculative decoding builds for the checkpoint, on CPU, from the ``VllmConfig`` vLLM makes of
eaglenest's ``speculative_config``, fills its parameters with NaN, loads the checkpoint through vLLM's own loader
and that class's ``load_weights``, and checks what was written: every parameter, from the checkpoint tensor(s)
of its name, with the checkpoint's values (q/k/v and gate/up concatenated in vLLM's order); every checkpoint
tensor written somewhere. Each algorithm is checked with a draft vocabulary and with the verifier's whole one,
whose checkpoints carry different tensors. The few exceptions are named below with the reason.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from eaglenest.artifacts.draft import draft_tokens, vllm_speculative_config
from eaglenest.artifacts.hidden_states.extract_params import ExtractParams
from eaglenest.stages.convert import convert
from eaglenest.stages.convert.params import ConvertParams
from eaglenest.stages.extract import extract_hidden_states
from eaglenest.stages.train import TrainPaths, train_draft
from eaglenest.stages.train.params import TrainParams
from tests.conftest import requires_vllm
from tests.fixtures.models import build_tiny_tokenizer
from tests.fixtures.pipeline import pipeline_until_prepare

# About 20 s on 2 cores in all (most of it importing vLLM and extracting hidden states): not marked slow.
pytestmark = requires_vllm

# The class vLLM 0.32 builds for each algorithm's checkpoint: `update_eagle3`, `update_peagle` and
# `update_dflash` (vllm/transformers_utils/configs/speculators/algos.py) name the architecture, the model
# registry maps it (PeagleLlamaForCausalLM and DFlashDraftModel to these classes).
VLLM_CLASSES = {
    "eagle3": "Eagle3LlamaForCausalLM",
    "peagle": "Eagle3LlamaForCausalLM",
    "dflash": "DFlashQwen3ForCausalLM",
}

# vLLM's stacked parameters and the checkpoint tensors its WeightsMapper stacks into them, in vLLM's order.
MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# Checkpoint tensors vLLM renames: `load_weights` turns `d2t` into the draft-to-target parameter.
RENAMED = {"draft_id_to_target_id": "d2t"}

# Parameters of vLLM's module that no checkpoint of this algorithm writes, and why that is correct.
NOT_FROM_CHECKPOINT: dict[str, dict[str, str]] = {
    "dflash": {
        "model.embed_tokens.weight": (
            "shared from the verifier: speculators' DFlash draft reads the verifier's frozen embedding and saves "
            "none; load_weights then leaves has_own_embed_tokens False, and vLLM's proposer "
            "(_maybe_share_embeddings, vllm/v1/spec_decode/llm_base_proposer.py) replaces this module with the "
            "verifier's embed_tokens"
        ),
        "model.mask_embedding": (
            "read only from a separate mask_embedding.pt beside the checkpoint (_read_mask_embedding); without one "
            "has_separate_mask_embedding stays False and embed_input_ids never reads it: masked slots embed "
            "mask_token_id through the (verifier's) embed_tokens, as in training"
        ),
    }
}
# The same, for a draft predicting the verifier's whole vocabulary (convert.draft_vocab_size: null).
NOT_FROM_CHECKPOINT_FULL_VOCABULARY: dict[str, dict[str, str]] = {
    "dflash": {
        "lm_head.weight": (
            "shared from the verifier: speculators keeps every head frozen at the verifier's (cut to the draft "
            "vocabulary when there is one) and DFlash saves it only when cut; load_weights then leaves "
            "has_own_lm_head False, and vLLM's proposer (_maybe_share_lm_head, "
            "vllm/v1/spec_decode/llm_base_proposer.py) replaces this head with the verifier's lm_head"
        )
    }
}
# Checkpoint tensors vLLM does not serve, and why nothing is lost.
NOT_SERVED = {
    "t2d": (
        "training only: speculators cuts the verifier's lm_head down to the draft vocabulary with this "
        "target-to-draft mask (the draft's head and its training targets, load_verifier_weights); vLLM maps "
        "draft ids to target ids from d2t alone (compute_logits: arange + d2t), and load_weights skips t2d by "
        "name. The test checks that t2d says nothing d2t does not"
    )
}

NUM_LAYERS = 6
K = 2
# convert.draft_vocab_size of each case: a draft vocabulary (d2t, t2d and a cut head in the checkpoint), or the
# verifier's whole one (none of them).
DRAFT_VOCABULARIES = {"draft-vocabulary": 64, "full-vocabulary": None}


def build_verifier_weights(path: Path) -> Path:
    """A random tiny Llama verifier whose head size (64 / 2 = 32) vLLM's CPU attention has kernels for: the
    draft classes build their attention layers from it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def training_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Verifier, prepared rows, hidden states and, for each of :data:`DRAFT_VOCABULARIES`, the vocabulary."""
    root = tmp_path_factory.mktemp("vllm-weights")
    model_dir = build_verifier_weights(root / "verifier-weights")
    verifier, prepared = pipeline_until_prepare(root, model_dir, rows=8)
    hs = root / "hs"
    extract_hidden_states(ExtractParams(dtype="float32"), verifier, prepared, hs, root / "extract.json")
    data = {"model": model_dir, "verifier": verifier, "prepared": prepared, "hs": hs}
    for case, size in DRAFT_VOCABULARIES.items():
        convert(
            ConvertParams(draft_vocab_size=size),
            ExtractParams(dtype="float32"),
            verifier,
            prepared,
            hs,
            root / case,
            root / f"{case}.json",
        )
        data[case] = root / case
    return data


@dataclass
class ParallelState:
    """vLLM's single-process distributed state, as this module uses it.

    Attributes:
        init_file: The file its process group rendezvous on.
        set_up_here: Whether this module set it up (and so tears it down).
    """

    init_file: Path
    set_up_here: bool = False


@pytest.fixture(scope="module")
def vllm_parallel_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ParallelState]:
    """The distributed state, torn down after the module if set up here, so that engines started later in this
    process set up their own."""
    state = ParallelState(tmp_path_factory.mktemp("vllm-dist") / "init")
    yield state
    if state.set_up_here:
        from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()


@contextmanager
def vllm_model_context(vllm_config: Any, state: ParallelState) -> Iterator[None]:
    """What vLLM's worker sets up before it builds a model: the current config and the tensor and pipeline
    parallel groups of one process (gloo, on CPU)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel, model_parallel_is_initialized

    with set_current_vllm_config(vllm_config):
        if not model_parallel_is_initialized():
            init_distributed_environment(
                world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method=f"file://{state.init_file}"
            )
            initialize_model_parallel(1, 1)
            state.set_up_here = True
        yield


def train(algorithm: str, vocabulary: Path, data: dict[str, Path], out: Path) -> Path:
    """A draft trained for 2 steps by the train stage's code: enough for every weight to leave its initial value.

    Args:
        algorithm: ``train.algorithm``.
        vocabulary: The convert stage's vocabulary folder the draft predicts.
        data: :func:`training_data`'s folders.
        out: Where the draft and the run's other outputs go.

    Returns:
        The draft's folder (a speculators checkpoint).
    """
    params = TrainParams(
        algorithm=algorithm,
        steps=2,
        eval_every=2,
        total_seq_len=128,
        warmup_steps=0,
        precision="float32",
        ttt_steps=K,
        verifier_name=str(data["model"]),
    )
    train_draft(
        params,
        TrainPaths(
            verifier=data["verifier"],
            prepared=data["prepared"],
            hidden_states=data["hs"],
            vocab=vocabulary,
            out=out / "draft",
            metrics=out / "train.json",
            details=out / "train_details.json",
            live_dir=out / "dvclive",
            checkpoints=out / "checkpoints",
        ),
    )
    return out / "draft"


def unset(tensor: torch.Tensor) -> torch.Tensor:
    """Where ``tensor`` still holds the fill of :func:`fill_unset` (NaN, or the lowest integer)."""
    if tensor.is_floating_point():
        return torch.isnan(tensor)
    return tensor == torch.iinfo(tensor.dtype).min


def fill_unset(tensor: torch.Tensor) -> None:
    """A value no trained weight or token offset holds, so that whatever loading leaves behind shows."""
    with torch.no_grad():
        tensor.fill_(math.nan if tensor.is_floating_point() else torch.iinfo(tensor.dtype).min)


def record_writes(model: torch.nn.Module, sources: dict[int, str]) -> dict[str, list[str]]:
    """Wraps each parameter's weight loader, the one call through which vLLM writes a checkpoint tensor into a
    parameter, to record which checkpoint tensors each parameter receives. A parameter without its own loader
    gets vLLM's default one, which is what vLLM would call for it.

    Args:
        model: vLLM's draft module, before loading.
        sources: The data pointer of each checkpoint tensor vLLM's reader yields -> its name; filled while
            loading, read at each write.

    Returns:
        Parameter name -> the names of the checkpoint tensors written into it, filled while loading.
    """
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    writes: dict[str, list[str]] = defaultdict(list)

    def recording(name: str, loader: Callable[..., Any]) -> Callable[..., Any]:
        def weight_loader(param: Any, loaded: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            writes[name].append(sources.get(loaded.data_ptr(), f"<not a checkpoint tensor {tuple(loaded.shape)}>"))
            return loader(param, loaded, *args, **kwargs)

        return weight_loader

    for name, param in model.named_parameters():
        param.weight_loader = recording(name, getattr(param, "weight_loader", default_weight_loader))
    return writes


def checkpoint_sources(param_name: str) -> list[str]:
    """The checkpoint tensors a vLLM parameter is to be loaded from, in the order vLLM stacks them.

    speculators saves the draft's modules under vLLM's names without the ``model.`` prefix, with q/k/v and
    gate/up unmerged and the draft-to-target offsets as ``d2t``.

    Args:
        param_name: The parameter's name in vLLM's module.

    Returns:
        The checkpoint names, one unless vLLM stacks several into the parameter.
    """
    name = param_name.removeprefix("model.")
    for merged, parts in MERGED.items():
        if f".{merged}." in name:
            return [name.replace(f".{merged}.", f".{part}.") for part in parts]
    return [RENAMED.get(name, name)]


def build_vllm_draft(draft: Path, verifier_weights: Path, state: ParallelState) -> tuple[Any, Any, Any, Any]:
    """vLLM's draft module for a checkpoint, built as vLLM's model loader builds it (on CPU, in the draft's
    dtype), from the engine config vLLM makes of eaglenest's ``speculative_config``, before any weight is loaded.

    Args:
        draft: The speculators checkpoint.
        verifier_weights: The verifier's model folder (the engine's model).
        state: vLLM's distributed state, set up here if it is not yet.

    Returns:
        The module, the engine config, the draft's model config and vLLM's loader for it.
    """
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    # float32 throughout: loaded values then equal the checkpoint's bit for bit.
    engine = EngineArgs(
        model=str(verifier_weights),
        dtype="float32",
        max_model_len=128,
        enforce_eager=True,
        skip_tokenizer_init=True,
        speculative_config=vllm_speculative_config(draft, draft_tokens(draft, "the draft")),
    )
    vllm_config = engine.create_engine_config()
    draft_config = vllm_config.speculative_config.draft_model_config
    loader = get_model_loader(vllm_config.load_config)
    with vllm_model_context(vllm_config, state), set_default_torch_dtype(draft_config.dtype), torch.device("cpu"):
        model = loader.create_model(vllm_config=vllm_config, model_config=draft_config)
    return model, vllm_config, draft_config, loader


@pytest.mark.parametrize("vocabulary", list(DRAFT_VOCABULARIES))
@pytest.mark.parametrize("algorithm", list(VLLM_CLASSES))
def test_vllm_writes_every_weight_of_the_draft_from_its_checkpoint(
    training_data: dict[str, Path], tmp_path: Path, vllm_parallel_state: ParallelState, algorithm: str, vocabulary: str
):
    """vLLM writes every parameter of its draft class from the checkpoint tensors of its name, with their values,
    and drops no checkpoint tensor; the exceptions are the ones named in this module, for the reasons given."""
    draft = train(algorithm, training_data[vocabulary], training_data, tmp_path)
    checkpoint = load_file(draft / "model.safetensors")
    model, vllm_config, draft_config, loader = build_vllm_draft(draft, training_data["model"], vllm_parallel_state)
    assert type(model).__name__ == VLLM_CLASSES[algorithm]

    exempt = dict(NOT_FROM_CHECKPOINT.get(algorithm, {}))
    if DRAFT_VOCABULARIES[vocabulary] is None:
        exempt.update(NOT_FROM_CHECKPOINT_FULL_VOCABULARY.get(algorithm, {}))
    params = dict(model.named_parameters())
    assert set(exempt) <= set(params), "an exemption names a parameter vLLM's class no longer has"
    for tensor in params.values():
        fill_unset(tensor)
    # Buffers are built, not loaded, unless the checkpoint carries them (P-EAGLE's mask_hidden).
    buffers = {name: buffer for name, buffer in model.named_buffers() if name.removeprefix("model.") in checkpoint}
    for tensor in buffers.values():
        fill_unset(tensor)

    # vLLM's loader reads the folder itself (file discovery, its safetensors reader). The tensors it yields are
    # kept and known by their storage, so that each one load_weights hands to a weight loader can be named.
    read: dict[str, torch.Tensor] = {}
    sources: dict[int, str] = {}
    vllm_reader = loader.get_all_weights

    def reading(*args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in vllm_reader(*args, **kwargs):
            assert tensor.data_ptr() not in sources, f"{name} shares storage with {sources[tensor.data_ptr()]}"
            read[name], sources[tensor.data_ptr()] = tensor, name
            yield name, tensor

    loader.get_all_weights = reading
    writes = record_writes(model, sources)
    with vllm_model_context(vllm_config, vllm_parallel_state), torch.no_grad():
        loader.load_weights(model, draft_config)
    assert read.keys() == checkpoint.keys(), "vLLM's reader did not yield exactly the checkpoint's tensors"
    for name, tensor in read.items():
        assert torch.equal(tensor, checkpoint[name]), name

    # Every parameter: written from the checkpoint tensor(s) of its name, with their values; or exempt, unwritten.
    problems = []
    for name, param in params.items():
        if name in exempt:
            if name in writes or not bool(unset(param).all()):
                problems.append(f"{name}: exempt ({exempt[name]}) but written")
            continue
        expected = checkpoint_sources(name)
        if sorted(writes.get(name, [])) != sorted(expected):
            problems.append(f"{name}: written from {writes.get(name, [])}, expected {expected}")
            continue
        if bool(unset(param).any()):
            problems.append(f"{name}: {int(unset(param).sum())} of {param.numel()} values not written")
            continue
        value = torch.cat([checkpoint[key] for key in expected]).to(param.dtype)
        # vLLM pads vocabulary tables to a multiple of 64 rows; its loader zeroes the padding.
        loaded, padding = param.data[: value.shape[0]], param.data[value.shape[0] :]
        if loaded.shape != value.shape or not torch.equal(loaded, value) or bool(padding.any()):
            problems.append(f"{name}: values differ from checkpoint {expected}")
    for name, buffer in buffers.items():
        key = name.removeprefix("model.")
        if not torch.equal(buffer, checkpoint[key].reshape(buffer.shape).to(buffer.dtype)):
            problems.append(f"buffer {name}: not the checkpoint's {key}")

    # Every checkpoint tensor: written into a parameter or a buffer, or named as not served.
    consumed = {key for keys in writes.values() for key in keys} | {name.removeprefix("model.") for name in buffers}
    ignored = sorted(set(checkpoint) - consumed - set(NOT_SERVED))
    if ignored:
        problems.append(f"checkpoint tensors vLLM drops: {ignored}")
    if consumed & set(NOT_SERVED):
        problems.append(f"listed as not served but loaded: {sorted(consumed & set(NOT_SERVED))}")
    assert not problems, f"{algorithm}, {vocabulary} ({type(model).__name__}):\n" + "\n".join(problems)

    # vLLM's proposer swaps in the verifier's embedding or head where the draft has none of its own (these flags,
    # set while loading): what was loaded must be kept, and what is exempt as shared must be swapped.
    assert model.has_own_embed_tokens is ("embed_tokens.weight" in checkpoint)
    assert model.has_own_lm_head is ("lm_head.weight" in checkpoint)
    if "model.mask_embedding" in exempt:
        assert model.model.has_separate_mask_embedding is False
    if DRAFT_VOCABULARIES[vocabulary] is None:
        assert "d2t" not in checkpoint and "draft_id_to_target_id" not in params
    else:
        # t2d, not served, says nothing that d2t does not: it marks exactly the target ids arange + d2t.
        d2t, t2d = checkpoint["d2t"], checkpoint["t2d"]
        assert torch.equal(t2d.nonzero().flatten(), torch.arange(d2t.numel()) + d2t)
