"""Shared by the test modules: running the real CLI tools (dvc, the stage scripts) in temporary git + DVC
repositories, and the first stages' code on a tiny verifier."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from eaglenest.core.chat import end_of_turn_ids
from eaglenest.core.params import PrepareParams, VerifierParams
from eaglenest.stages.prepare import prepare_dataset
from eaglenest.stages.verifier import build_verifier

from .conftest import build_tiny_tokenizer, write_jsonl

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def project_env(**extra: str) -> dict[str, str]:
    """The environment `make` gives stages: the project's interpreter first on PATH, offline."""
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"})
    env.update(extra)
    return env


def run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, check: bool = True,
        timeout: int = 900) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, cwd=cwd, env=env or project_env(), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{cmd} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def make_pipeline_repo(dest: Path, params_overrides: dict | None = None) -> Path:
    """A fresh git + DVC repository holding this project's pipeline, with params overridden."""
    dest.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".*")
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy(REPO / name, dest / name)
    for name in ("stages", "src"):
        shutil.copytree(REPO / name, dest / name, ignore=ignore)
    shutil.copytree(REPO / "data" / "eval", dest / "data" / "eval")  # the general evaluation set
    # the shipped conversation sources (builtin:python-functions' snapshot), as a clone has them
    shutil.copytree(REPO / "data" / "conversations", dest / "data" / "conversations")
    params = yaml.safe_load((dest / "params.yaml").read_text())
    for section, values in (params_overrides or {}).items():
        params.setdefault(section, {}).update(values)
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run(["git", "init", "-q"], dest)
    run([str(VENV_BIN / "dvc"), "init", "-q"], dest)
    run([str(VENV_BIN / "dvc"), "config", "core.analytics", "false"], dest)
    run(["git", "add", "-A"], dest)
    run(["git", "commit", "-qm", "pipeline"], dest)
    return dest


def dvc(args: list[str], repo: Path, check: bool = True, env: dict[str, str] | None = None):
    return run([str(VENV_BIN / "dvc"), *args], repo, env=env, check=check)


# Chat templates written for the tiny tokenizer to behave as Qwen3's and Kimi-K2's are documented to: thinking
# of earlier turns dropped (Qwen3: the reply alone; Kimi-K2: an empty think block), the reply after the last user
# message keeps <think> (Qwen3 reads it from reasoning_content or the content, Kimi-K2 from reasoning_content),
# and enable_thinking=False puts an empty think block into the generation prompt.
QWEN3_LIKE = (
    "{% set ns = namespace(last_query=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}"
    "{% set content = m['content'] %}{% set reasoning = '' %}"
    "{% if m.reasoning_content is defined and m.reasoning_content is not none %}"
    "{% set reasoning = m.reasoning_content %}"
    "{% elif '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{% endif %}"
    "{% if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "<|assistant|>\n<think>\n{{ reasoning.strip('\n') }}\n</think>\n\n{{ content.lstrip('\n') }}<|end|>\n"
    "{% else %}<|assistant|>\n{{ content }}<|end|>\n{% endif %}"
    "{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)

KIMI_K2_LIKE = (
    "{% set ns = namespace(last_query=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>\n"
    "{% if loop.index0 > ns.last_query %}<think>{{ m.reasoning_content or '' }}</think>"
    "{% else %}<think></think>{% endif %}"
    "{{ m['content'] }}<|end|>\n"
    "{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}{% endif %}"
)

TEXTS = ["hello there", "what is the capital of France?", "the weather is nice", "I am fine thanks and you"]


def pipeline_until_prepare(tmp: Path, model_dir: Path, rows: int = 10, trust_remote_code: bool = False,
                           chat_template: str | None = None, reasoning: str | None = None) -> tuple[Path, Path]:
    """Runs the verifier and prepare stages' code on a tiny model and synthetic chats of varied length (rendered
    with ``chat_template`` instead of the tiny tokenizer's own, and ``prepare.reasoning``, when given)."""
    verifier_dir = tmp / "models" / "verifier"
    build_verifier(VerifierParams(model=str(model_dir), aux_layers=[1, 3, 5], trust_remote_code=trust_remote_code),
                   verifier_dir)
    records = []
    for i in range(rows):
        user = " ".join(TEXTS[: 1 + i % 4])
        records.append({"messages": [{"role": "user", "content": user},
                                     {"role": "assistant", "content": TEXTS[i % 4] * (1 + i % 3)}]})
    source = write_jsonl(tmp / "chats.jsonl", records)
    tokenizer = build_tiny_tokenizer()
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    prepared = tmp / "data" / "prepared"
    prepare_dataset(PrepareParams(source=[str(source)], max_conversations=None, val_fraction=0.2, reasoning=reasoning),
                    tokenizer,
                    prepared, tmp / "metrics" / "prepare.json", end_of_turn_ids(tokenizer))
    return verifier_dir, prepared


def evaluate_params(repo: Path, dest: Path, **evaluate: object) -> Path:
    """``repo``'s params with ``evaluate`` values on top, written under ``dest``; ``num_prompts`` and
    ``max_new_tokens`` set the one set's (``val``, the held-out prompts, or ``source``)."""
    params = yaml.safe_load((repo / "params.yaml").read_text())
    one_set = dict(params["evaluate"]["sets"][0])
    for key in ("num_prompts", "max_new_tokens", "source"):
        if key in evaluate:
            one_set[key] = evaluate.pop(key)
    # The back ends are compared on one set; more would multiply each run's time.
    params["evaluate"].update({"sets": [one_set], **evaluate})
    path = dest / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def run_train(repo: Path, dest: Path, **train: object) -> Path:
    """The real train stage on ``repo``'s verifier and hidden states, with ``train`` values on top of ``repo``'s
    params; returns the draft folder (under ``dest``, with every other output)."""
    dest.mkdir(parents=True, exist_ok=True)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["train"].update(train)
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run([sys.executable, str(REPO / "stages" / "train.py"), "--params", str(dest / "params.yaml"),
         "--verifier", str(repo / "models" / "verifier"), "--prepared", str(repo / "data" / "prepared"),
         "--hidden-states", str(repo / "data" / "hidden_states"), "--vocab", str(repo / "data" / "vocab"),
         "--out", str(dest / "draft"), "--metrics", str(dest / "train.json"),
         "--details", str(dest / "train_details.json"), "--live-dir", str(dest / "dvclive")], dest, timeout=1800)
    return dest / "draft"


def set_figures(details: dict, backend: str, set_name: str | None = None) -> dict:
    """One back end's figures on one set (the first by default) from metrics/eval/details.json, flat:
    ``tau``, ``speedup`` and ``ngram_tau`` as values, the rest of the summary and the run's settings as they are."""
    run = details["runs"][backend]
    entry = run["sets"][set_name or next(iter(run["sets"]))]
    summary = entry["summary"]
    flat = {key: value for key, value in summary.items() if not isinstance(value, dict)}
    flat.update({name: summary[name]["value"] for name in ("tau", "speedup", "ngram_tau", "ngram_speedup")
                 if name in summary})
    flat.update(dtype=run["dtype"], num_speculative_tokens=details["num_speculative_tokens"],
                lossless_rule=entry.get("lossless_rule", "exact"), backend=backend)
    return flat


def run_evaluate(repo: Path, dest: Path, *, wrapper: Path | None = None, env: dict[str, str] | None = None,
                 draft: Path | None = None, prepared: Path | None = None, **evaluate: object
                 ) -> tuple[subprocess.CompletedProcess[str], dict]:
    """The real stage script on ``repo``'s verifier, prompts and draft; every output goes under ``dest``.

    Returns the run and the first back end's figures on its one set (:func:`set_figures`; empty if it wrote none).
    """
    dest.mkdir(parents=True, exist_ok=True)
    stage = str(REPO / "stages" / "evaluate.py")
    script = [str(wrapper), stage] if wrapper else [stage]
    cmd = [sys.executable, *script, "--params", str(evaluate_params(repo, dest, **evaluate)),
           "--verifier", str(repo / "models" / "verifier"), "--prepared", str(prepared or repo / "data" / "prepared"),
           "--draft", str(draft or repo / "models" / "draft"), "--metrics", str(dest / "eval.json"),
           "--out", str(dest / "eval")]
    result = subprocess.run(cmd, cwd=dest, env=project_env(**(env or {})), capture_output=True, text=True,
                            timeout=900)
    details_file = dest / "eval" / "details.json"
    if not details_file.exists():
        return result, {}
    details = json.loads(details_file.read_text())
    return result, set_figures(details, next(iter(details["runs"])))


@functools.cache
def hf_reference(repo: str, dest: str) -> dict:
    """The hf back end's metrics on ``repo``'s draft and prompts (cached: test_serve compares with it too)."""
    result, metrics = run_evaluate(Path(repo), Path(dest), backend="hf")
    assert result.returncode == 0, result.stderr
    return metrics


def equal_length_training_data(root: Path, model_dir: Path) -> None:
    """verifier, prepared, hs and vocab under ``root``: 8 train rows of equal length and loss-token count
    (different content) and 2 validation rows, so that every step can use all train rows, as 1 sequence of
    192 tokens or as 2 processes x 96."""
    import torch

    from eaglenest.artifacts.prepared import write_prepared
    from eaglenest.core.params import ConvertParams, ExtractParams
    from eaglenest.stages.convert import convert
    from eaglenest.stages.extract import extract_hidden_states

    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(5, 300, (24,), generator=generator).tolist() for _ in range(10)]
    masks = [[0] * 8 + [1] * 16 for _ in range(10)]
    write_prepared(root / "prepared", ids, masks, train_rows=8, val_prompts=[])
    build_verifier(VerifierParams(model=str(model_dir), aux_layers=[1, 3, 5]), root / "verifier")
    extract_hidden_states(ExtractParams(dtype="float32"), root / "verifier", root / "prepared", root / "hs",
                          root / "extract.json")
    convert(ConvertParams(draft_vocab_size=None), ExtractParams(dtype="float32"), root / "verifier",
            root / "prepared", root / "hs",
            root / "vocab", root / "data.json")


def expected_from_pieces(tokenizer, pieces: list[tuple[str, int]]) -> tuple[list[int], list[int]]:
    """Tokenises each (text, label) piece alone; the label applies to every token of the piece."""
    ids, mask = [], []
    for text, label in pieces:
        piece_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece_ids
        mask += [label] * len(piece_ids)
    return ids, mask


def stored_row(folder: Path, row: int) -> dict:
    """Row ``row``'s tensors as stored, from its row file or from the shard holding it."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    from eaglenest.artifacts.hidden_states import hs_path, read_shard_row, shard_row_index

    if hs_path(folder, row).is_file():
        return load_file(hs_path(folder, row))
    for shard in sorted(folder.glob("shard_*.safetensors")):
        index = shard_row_index(shard)
        if row in index:
            with safe_open(str(shard), framework="pt") as handle:
                return {key: torch.clone(value) for key, value in read_shard_row(handle, *index[row]).items()}
    raise FileNotFoundError(f"{folder}: row {row} is in no row file and no shard")
