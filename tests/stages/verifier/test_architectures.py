"""The verifiers people train drafts for, end to end on CPU: tiny random DeepSeek-V3 (MoE + multi-head latent
attention), Qwen3 and Qwen3-MoE verifiers built from transformers' own classes go through prepare, extract
(hf), convert, train and evaluate (hf); the stored slots are the verifier's own hidden states, and greedy
speculative decoding is lossless."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from eaglenest.artifacts.hidden_states.extract_params import ExtractParams
from eaglenest.artifacts.prepared import load_chat_kwargs
from eaglenest.stages.convert import convert
from eaglenest.stages.convert.params import ConvertParams
from eaglenest.stages.extract import extract_hidden_states
from eaglenest.stages.train import TrainPaths, train_draft
from eaglenest.stages.train.params import TrainParams
from tests.fixtures.models import NUM_LAYERS, QWEN3_LIKE, build_tiny_tokenizer, build_verifier_folder
from tests.fixtures.pipeline import REPO, pipeline_until_prepare, run_evaluate, stored_row

AUX_LAYERS = [1, 3, 5]  # pipeline_until_prepare's; the last slot is layer 6, before the final norm


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3", "qwen3_moe"])
def test_verifier_family_end_to_end(tmp_path: Path, arch: str):
    from transformers import AutoModelForCausalLM

    # The Qwen3 verifier has a Qwen3-like reasoning template, trained on answers only (prepare.reasoning: strip):
    # prepare, regeneration-free rendering and evaluate's prompts all carry the empty think block.
    template, reasoning = (QWEN3_LIKE, "strip") if arch == "qwen3" else (None, None)
    model_dir = build_verifier_folder(tmp_path / "verifier-weights", arch, template)
    verifier, prepared = pipeline_until_prepare(
        tmp_path, model_dir, rows=12, chat_template=template, reasoning=reasoning
    )
    assert load_chat_kwargs(prepared) == ({"enable_thinking": False} if reasoning else {})
    hs = tmp_path / "data" / "hidden_states"
    extract_hidden_states(ExtractParams(dtype="float32"), verifier, prepared, hs, tmp_path / "extract.json")

    # The stored slots are transformers' own hidden states: after layers 1, 3 and 5, and after layer 6 before
    # the final norm (transformers' last entry is after it).
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    stored = stored_row(hs, 0)  # row 0 of shard 0 (the default packs 256 rows a shard)
    with torch.no_grad():
        output = model(input_ids=stored["token_ids"][None], output_hidden_states=True)
        slots = stored["hidden_states"]  # [seq, 4, hidden]
        for slot, layer in enumerate(AUX_LAYERS):
            torch.testing.assert_close(slots[:, slot], output.hidden_states[layer][0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(
            model.model.norm(slots[:, -1]), output.hidden_states[NUM_LAYERS][0], rtol=1e-4, atol=1e-5
        )

    convert(
        ConvertParams(draft_vocab_size=64),
        ExtractParams(dtype="float32"),
        verifier,
        prepared,
        hs,
        tmp_path / "data" / "vocab",
        tmp_path / "data.json",
    )
    # The Qwen3 verifier gets a draft of its own family's layer (train.draft_arch), the others a Llama layer.
    draft_arch = "qwen3" if arch == "qwen3" else "llama"
    metrics = train_draft(
        TrainParams(steps=4, eval_every=2, total_seq_len=256, warmup_steps=1, draft_arch=draft_arch),
        TrainPaths(
            verifier=verifier,
            prepared=prepared,
            hidden_states=hs,
            vocab=tmp_path / "data" / "vocab",
            out=tmp_path / "models" / "draft",
            metrics=tmp_path / "train.json",
            details=tmp_path / "train_details.json",
            live_dir=tmp_path / "dvclive",
            checkpoints=tmp_path / "checkpoints",
        ),
    )
    assert metrics["steps"] == 4 and torch.isfinite(torch.tensor(metrics["val_loss"]))
    draft_config = json.loads((tmp_path / "models" / "draft" / "config.json").read_text())
    assert draft_config["speculators_model_type"] == "eagle3"
    assert draft_config["transformer_layer_config"]["hidden_size"] == 32
    assert draft_config["transformer_layer_config"]["model_type"] == draft_arch

    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    result, evaluation = run_evaluate(tmp_path, tmp_path / "eval", backend="hf", num_prompts=2, max_new_tokens=8)
    assert result.returncode == 0, result.stderr[-3000:]
    assert evaluation["lossless_fraction"] == 1.0
    assert evaluation["tau"] >= 1.0


CONFIGURATION_CODE = """from transformers import LlamaConfig


class EaglenestCustomConfig(LlamaConfig):
    model_type = "eaglenest_custom"
"""

MODELING_CODE = """from transformers import LlamaForCausalLM, LlamaModel

from .configuration_custom import EaglenestCustomConfig


class EaglenestCustomModel(LlamaModel):
    config_class = EaglenestCustomConfig


class EaglenestCustomForCausalLM(LlamaForCausalLM):
    config_class = EaglenestCustomConfig
"""


def build_remote_code_verifier(path: Path) -> Path:
    """A verifier whose model type transformers does not know: its classes are Python files in the folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    (path / "configuration_custom.py").write_text(CONFIGURATION_CODE)
    (path / "modeling_custom.py").write_text(MODELING_CODE)
    raw = json.loads((path / "config.json").read_text())
    raw.update(
        {
            "model_type": "eaglenest_custom",
            "architectures": ["EaglenestCustomForCausalLM"],
            "auto_map": {
                "AutoConfig": "configuration_custom.EaglenestCustomConfig",
                "AutoModel": "modeling_custom.EaglenestCustomModel",
                "AutoModelForCausalLM": "modeling_custom.EaglenestCustomForCausalLM",
            },
        }
    )
    (path / "config.json").write_text(json.dumps(raw))
    return path


@pytest.mark.slow
def test_a_remote_code_verifier_runs_only_with_trust_remote_code(tmp_path: Path):
    from eaglenest.core.errors import ParamsError
    from eaglenest.stages.verifier import build_verifier
    from eaglenest.stages.verifier.params import VerifierParams

    model_dir = build_remote_code_verifier(tmp_path / "custom")
    with pytest.raises(ParamsError, match=r"needs its own Python code.*verifier.trust_remote_code: true"):
        build_verifier(VerifierParams(model=str(model_dir), aux_layers=AUX_LAYERS), tmp_path / "refused")

    verifier, prepared = pipeline_until_prepare(tmp_path, model_dir, rows=12, trust_remote_code=True)
    assert json.loads((verifier / "verifier.json").read_text())["model_type"] == "eaglenest_custom"
    hs = tmp_path / "data" / "hidden_states"
    extract_hidden_states(ExtractParams(), verifier, prepared, hs, tmp_path / "extract.json")
    convert(
        ConvertParams(draft_vocab_size=64),
        ExtractParams(dtype="bfloat16"),
        verifier,
        prepared,
        hs,
        tmp_path / "data" / "vocab",
        tmp_path / "data.json",
    )
    train_draft(
        TrainParams(steps=2, eval_every=2, total_seq_len=256),
        TrainPaths(
            verifier=verifier,
            prepared=prepared,
            hidden_states=hs,
            vocab=tmp_path / "data" / "vocab",
            out=tmp_path / "models" / "draft",
            metrics=tmp_path / "train.json",
            details=tmp_path / "train_details.json",
            live_dir=tmp_path / "dvclive",
            checkpoints=tmp_path / "checkpoints",
        ),
    )
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    result, evaluation = run_evaluate(tmp_path, tmp_path / "eval", backend="hf", num_prompts=2, max_new_tokens=8)
    assert result.returncode == 0, result.stderr[-3000:]
    assert evaluation["lossless_fraction"] == 1.0


def test_a_verifier_whose_decoder_layers_cannot_be_located_is_one_line(tmp_path: Path):
    """GPT-2 keeps its blocks in `.h` and its final norm in `.ln_f`: the hf back end cannot hook them."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from eaglenest.core.errors import EaglenestError

    tokenizer = build_tiny_tokenizer()
    model_dir = tmp_path / "gpt2"
    GPT2LMHeadModel(
        GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=NUM_LAYERS, n_head=4, n_positions=512)
    ).save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)
    verifier, prepared = pipeline_until_prepare(tmp_path, model_dir, rows=4)
    with pytest.raises(
        EaglenestError,
        match=r"verifier .*gpt2 \(gpt2, GPT2Model\): no `.layers` list and final "
        r"`.norm` .* fix: extract.backend: vllm",
    ):
        extract_hidden_states(ExtractParams(), verifier, prepared, tmp_path / "hs", tmp_path / "extract.json")


@pytest.mark.slow
def test_deepseek_v3_with_a_reasoning_template_through_dvc_repro(tmp_path: Path):
    """The Kimi-K2.5 recipe in miniature, through the real `dvc repro`: an MoE + MLA verifier whose Kimi-K2-like
    template drops earlier turns' thinking, conversations with reasoning_content, thinking kept."""
    from tests.fixtures.models import KIMI_K2_LIKE, write_jsonl
    from tests.fixtures.pipeline import dvc, make_pipeline_repo

    model = build_verifier_folder(tmp_path / "deepseek", "deepseek_v3", KIMI_K2_LIKE)
    repo = make_pipeline_repo(
        tmp_path / "repo",
        {
            "verifier": {"model": str(model), "aux_layers": AUX_LAYERS},
            "prepare": {
                "source": ["data/conversations/chats.jsonl"],
                "max_conversations": None,
                "val_fraction": 0.25,
                "max_assistant_turns": None,
                "regenerate": False,
                "reasoning": "keep",
            },
            "convert": {"draft_vocab_size": 64},
            "train": {"steps": 2, "eval_every": 1, "total_seq_len": 256},
            "evaluate": {
                "backend": "hf",
                "sets": [{"name": "val", "source": "val", "num_prompts": 1, "max_new_tokens": 4, "headline": True}],
            },
        },
    )
    records = [
        {
            "messages": [
                {"role": "user", "content": f"hello there {i}"},
                {"role": "assistant", "content": "I am fine thanks", "reasoning_content": "the weather is nice"},
                {"role": "user", "content": "what is the capital of France?"},
                {"role": "assistant", "content": "Paris is the capital.", "reasoning_content": f"numbers {i}"},
            ]
        }
        for i in range(8)
    ]
    write_jsonl(repo / "data/conversations/chats.jsonl", records)

    dvc(["repro"], repo)
    prepared = json.loads((repo / "metrics/prepare.json").read_text())
    assert (prepared["kept"], prepared["rows"], prepared["train_rows"]) == (8, 16, 12)  # one row per reply
    assert json.loads((repo / "metrics/eval.json").read_text())["lossless"] == 1.0
    again = dvc(["repro"], repo)
    assert "Running stage" not in again.stdout
