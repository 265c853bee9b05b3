"""Shared fixtures: tiny tokenizers and verifiers built on the spot, and an offline, isolated DVC."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

# A Phi-3-like template, deliberately unlike SmolLM2's ChatML: the mask logic must not assume ChatML.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TINY_SPECIALS = ["<unk>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
TINY_CORPUS = [
    "hello there how are you today",
    "I am fine thanks and you",
    "the weather is nice, let us go for a walk",
    "what is the capital of France? Paris is the capital.",
    "numbers 0 1 2 3 4 5 6 7 8 9 and punctuation ! ? . ,",
]


@pytest.fixture(autouse=True)
def _isolated_dvc(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """DVC's site cache and analytics stay out of the user's machine."""
    monkeypatch.setenv("DVC_SITE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "dvc-site-cache"))
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")


@pytest.fixture(autouse=True)
def _isolated_weight_hashes(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process verifier stages remember weight hashes in the session's temp folder, not the checkout."""
    from eaglenest.stages import verifier

    monkeypatch.setattr(verifier, "WEIGHT_HASH_CACHE", tmp_path_factory.getbasetemp() / "weight-hashes.json")


def build_tiny_tokenizer():
    """A byte-level BPE tokenizer trained on a few sentences, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=TINY_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TINY_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", unk_token="<unk>", pad_token="<|end|>")
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


def build_tiny_verifier(path: Path, num_layers: int = 8, auto_map: bool = False) -> Path:
    """A random tiny Llama verifier with the tiny tokenizer, saved as a local model folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    if auto_map:
        config_file = path / "config.json"
        raw = json.loads(config_file.read_text())
        raw["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomModel"}
        config_file.write_text(json.dumps(raw))
    return path


@pytest.fixture(scope="session")
def tiny_verifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_verifier(tmp_path_factory.mktemp("tiny-verifier"))


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's real tokenizer and chat template, read from the packaged GGUF."""
    from transformers import AutoTokenizer

    from eaglenest.stages.verifier import BUILTIN_VERIFIERS, _builtin_gguf

    gguf = _builtin_gguf(BUILTIN_VERIFIERS.get("smollm2-135m-instruct"))
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


# --- Real vLLM ------------------------------------------------------------------------------------------
# The vLLM tests run whenever vLLM is installed (`make setup` installs its CPU build on a machine without a
# GPU) and are skipped, with the reason, only where it is absent.
def _vllm_absent_reason() -> str | None:
    from eaglenest.core.vllm_support import installed_build

    build = installed_build()
    return None if build is not None else "vLLM is not installed (make setup VLLM=cpu|gpu installs it)"


requires_vllm = pytest.mark.skipif(_vllm_absent_reason() is not None, reason=str(_vllm_absent_reason()))

# A tiny configuration of the real default pipeline, trained far enough that drafts are accepted.
SMOLLM2_TINY_PARAMS = {
    "prepare": {"max_conversations": 96, "max_len": 256},
    "extract": {"batch_tokens": 2048},
    "train": {"steps": 120, "eval_every": 40, "checkpoint_every": 40, "total_seq_len": 1024},
    "evaluate": {"sets": [{"name": "val", "source": "val", "num_prompts": 4, "max_new_tokens": 32, "headline": True}]},
}


@pytest.fixture(scope="session")
def smollm2_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DVC repo of the default pipeline (SmolLM2, chitchat) run through `train` on a tiny configuration:
    models/verifier, data/prepared, data/hidden_states, data/vocab and models/draft. Built once per session
    (about 3 minutes on 2 cores); EAGLENEST_TEST_SMOLLM2_REPO points at an existing one while developing."""
    from .helpers import VENV_BIN, make_pipeline_repo, run

    existing = os.environ.get("EAGLENEST_TEST_SMOLLM2_REPO")
    if existing:
        return Path(existing)
    repo = make_pipeline_repo(tmp_path_factory.mktemp("smollm2") / "repo", SMOLLM2_TINY_PARAMS)
    run([str(VENV_BIN / "dvc"), "repro", "train"], repo, timeout=2400)  # minutes when the machine is busy
    return repo


@pytest.fixture
def native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU that multiplies bf16 in hardware, whatever this machine's is (vLLM's dtype auto is bf16 there)."""
    from eaglenest.core import device

    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: True)


@pytest.fixture
def pipeline_folders(tmp_path: Path, tiny_verifier_dir: Path) -> tuple[Path, Path]:
    """A verifier stage record pointing at the tiny verifier, and a minimal EAGLE-3 speculators draft (K = 3)."""
    verifier = tmp_path / "models" / "verifier"
    verifier.mkdir(parents=True)
    (verifier / "verifier.json").write_text(json.dumps({
        "source": str(tiny_verifier_dir), "kind": "local", "path": str(tiny_verifier_dir), "name": "tiny/llama",
        "fingerprint": "0" * 64, "model_type": "llama", "num_layers": 8, "hidden_size": 32, "vocab_size": 300,
        "max_position_embeddings": 512, "aux_layers": [2, 4, 5], "layer_ids": [2, 4, 5, 8],
        "trust_remote_code": False,
    }))
    draft = tmp_path / "models" / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({
        "speculators_model_type": "eagle3",
        "speculators_config": {"proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}]},
    }))
    (draft / "model.safetensors").write_bytes(b"")
    return verifier, draft
