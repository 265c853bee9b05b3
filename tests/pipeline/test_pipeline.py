"""End to end: the real `dvc repro` of verifier and prepare, and a second repro that skips both."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from datasets import load_from_disk
from safetensors.torch import load_file, save_file

from eaglenest.artifacts.draft_hash import draft_fingerprint
from eaglenest.commands.params_file import parse_params
from eaglenest.core.errors import ParamsError
from eaglenest.core.params import parse_sections
from eaglenest.stages.prepare.params import PrepareParams, PrepareStageParams
from tests.fixtures.models import write_jsonl
from tests.fixtures.pipeline import SHARED_PARAMS, STAGES, SharedPipeline, dvc, make_pipeline_repo


def assert_all_skipped(output: str) -> None:
    assert "Running stage" not in output, output
    for stage in STAGES:
        assert f"Stage '{stage}' didn't change, skipping" in output


@pytest.mark.slow
def test_default_verifier_and_mix_through_dvc_repro(shared_pipeline: SharedPipeline):
    """The shared pipeline's one `dvc repro`: every stage ran, and each output is what the stage promises."""
    repo, first = shared_pipeline.repo, shared_pipeline.first_repro
    for stage in STAGES:
        assert f"Running stage '{stage}'" in first
    conversations = SHARED_PARAMS["prepare"]["max_conversations"]

    info = json.loads((repo / "models/verifier/verifier.json").read_text())
    assert info["kind"] == "builtin" and info["path"] == "."
    assert (info["num_layers"], info["hidden_size"], info["vocab_size"]) == (30, 576, 49152)
    assert info["aux_layers"] == [2, 15, 27] and info["layer_ids"] == [2, 15, 27, 30]
    assert info["name"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    config = json.loads((repo / "models/verifier/config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert (repo / "models/verifier/model.safetensors").stat().st_size > 500_000_000  # fp32, 135M params
    assert (repo / "models/verifier/chat_template.jinja").is_file()

    metrics = json.loads((repo / "metrics/prepare.json").read_text())
    assert metrics["kept"] == conversations and metrics["train_rows"] + metrics["val_rows"] == conversations
    dataset = load_from_disk(str(repo / "data/prepared"))
    max_len = SHARED_PARAMS["prepare"]["max_len"]
    assert len(dataset) == conversations and max(int(n) for n in dataset["seq_len"]) <= max_len
    assert metrics["loss_tokens"] == sum(int(m.sum()) for m in dataset["loss_mask"])
    # the defaults regenerate each kept conversation's first reply with the verifier itself
    assert metrics["regenerated_turns"] == conversations and metrics["regenerate_tokens_per_s"] > 0

    extract = json.loads((repo / "metrics/extract.json").read_text())
    assert extract["rows"] == conversations and extract["tokens"] == metrics["tokens"]
    assert extract["bytes_per_token"] == pytest.approx(4 * 576 * 2 + 8, rel=0.01)  # bf16, 4 slots
    hs_dir = repo / "data/hidden_states"
    assert [p.name for p in hs_dir.iterdir()] == ["shard_0.safetensors"]  # the default packs 256 rows a shard
    assert extract["files"] == 1 and extract["rows_per_shard"] == 256
    data = json.loads((repo / "metrics/data.json").read_text())
    assert data["samples"] == conversations and data["excluded"] == 0 and data["draft_vocab_size"] == 4096
    assert data["vocab_coverage_train"] == 1.0  # a few short chats have far fewer than 4096 distinct tokens
    assert 0.5 < data["vocab_coverage_val"] <= 1.0
    assert (repo / "data/vocab/d2t-4096.npy").is_file() and (repo / "data/vocab/t2d-4096.npy").is_file()
    train_details = json.loads((repo / "metrics/train_details.json").read_text())
    k = yaml.safe_load((repo / "params.yaml").read_text())["train"]["ttt_steps"]  # the draft's K
    assert train_details["steps"] == SHARED_PARAMS["train"]["steps"] and len(train_details["val_acc"]) == k
    draft = json.loads((repo / "models/draft/config.json").read_text())
    assert draft["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert draft["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27] and draft["draft_vocab_size"] == 4096
    # the headline: per headline set, the serving back end's tau and speed-up with their intervals, n-gram's
    evaluation = json.loads((repo / "metrics/eval.json").read_text())
    headline = [s["name"] for s in SHARED_PARAMS["evaluate"]["sets"] if s.get("headline")]
    assert set(evaluation) == {*headline, "lossless"} and evaluation["lossless"] == 1.0
    for name in headline:
        figures = evaluation[name]
        assert set(figures) == {
            "vllm_tau",
            "vllm_tau_ci95",
            "vllm_speedup",
            "vllm_speedup_ci95",
            "vllm_vs_free",
            "vllm_vs_free_ci95",
            "vllm_free",
            "vllm_tau_timed",
            # each free drafter's speed-up, and the hybrid's with its speed over the fastest free drafter
            "vllm_ngram_speedup",
            "vllm_suffix_speedup",
            "vllm_hybrid_speedup",
            "vllm_hybrid_vs_free",
            "vllm_hybrid_vs_free_ci95",
        }, figures
        assert 1.0 <= figures["vllm_tau"] <= 4.0 and figures["vllm_tau_ci95"] >= 0 and figures["vllm_speedup"] > 0
    records = json.loads((repo / "metrics/eval/records.json").read_text())
    mt = records["runs"]["vllm"]["sets"]["mt"]["records"]
    assert [(r["id"], r["turn"]) for r in mt] == [("81", 1), ("81", 2), ("111", 1), ("111", 2)]  # both turns
    assert mt[1]["prompt_tokens"] > mt[0]["prompt_tokens"] + 8  # turn 2 follows the verifier's own answer
    humaneval = records["runs"]["hf"]["sets"]["humaneval"]["records"]
    assert [r["id"] for r in humaneval] == ["HumanEval/0", "HumanEval/1"]
    details = shared_pipeline.details()
    for backend in ("hf", "vllm"):
        summary = details["runs"][backend]["sets"]["mt"]["summary"]
        assert summary["lossless_fraction"] == 1.0 and len(summary["per_position_acceptance"]) == k
        assert summary["num_prompts"] == 2 and summary["num_turns"] == 4 and summary["speedup"]["value"] > 0
        assert set(summary["categories"]) == {"writing", "math"}
    assert details["runs"]["vllm"]["sets"]["chat-t07"]["temperature"] == 0.7
    train = json.loads((repo / "metrics/train.json").read_text())
    assert set(train) == {"tau_sim", "val_loss_all_tokens"} and train["tau_sim"] >= 1.0
    # the plan: one method for this very draft, chosen among the ones evaluate timed
    plan = json.loads((repo / "metrics/serving_plan.json").read_text())
    assert plan["draft_sha256"] == draft_fingerprint(repo / "models/draft") and plan["method"] in plan["pooled"] | {
        "plain": 1
    }
    assert set(plan["pooled"]) == {"ngram", "suffix", "draft", "hybrid"} and plan["hybrid"]["suffix"]["threshold"] > 0
    shown = json.loads(dvc(["metrics", "show", "--json"], repo).stdout)
    numbers = [v for files in shown[""]["data"].values() for v in _leaves(files["data"])]
    # a dozen numbers per headline set (three here), lossless, train's two: a glance
    assert len(numbers) <= 12 * len(headline) + 3, numbers
    assert_all_skipped(dvc(["repro"], repo).stdout)


def draft_hash(repo: Path) -> str:
    """models/draft's hash as dvc.lock records it."""
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    return next(out["md5"] for out in lock["stages"]["train"]["outs"] if out["path"] == "models/draft")


CHAT = [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": "I am fine thanks"}]


def tiny_pipeline_repo(tmp_path: Path, tiny_verifier_dir: Path) -> tuple[Path, Path]:
    """(the verifier folder, the repository): the tiny verifier used in place and 8 one-turn conversations."""
    model = tmp_path / "my-verifier"
    shutil.copytree(tiny_verifier_dir, model)
    repo = make_pipeline_repo(
        tmp_path / "repo",
        {
            "verifier": {"model": str(model)},
            # vLLM's CPU build has no attention kernel for the tiny model's head size 8: hf regenerates here
            "prepare": {
                "source": ["data/conversations/chats.jsonl"],
                "max_conversations": None,
                "val_fraction": 0.25,
                "regenerate_backend": "hf",
            },
            "convert": {"draft_vocab_size": 64},
            "train": {"steps": 2, "eval_every": 1, "total_seq_len": 256},
            "evaluate": {
                "backend": "hf",
                "sets": [{"name": "val", "source": "val", "num_prompts": 1, "max_new_tokens": 4, "headline": True}],
            },
        },
    )
    write_jsonl(repo / "data/conversations/chats.jsonl", [{"conversations": CHAT}] * 8)
    return model, repo


@pytest.mark.slow
def test_own_verifier_and_conversations(tmp_path: Path, tiny_verifier_dir: Path):
    """The README's path for real users: a local verifier, used in place, and a JSONL of conversations."""
    model, repo = tiny_pipeline_repo(tmp_path, tiny_verifier_dir)
    chat = CHAT

    # The first conversations as far as prepare: the later stages first run on the next ones.
    dvc(["repro", "prepare"], repo)
    assert sorted(p.name for p in (repo / "models/verifier").iterdir()) == ["verifier.json"]
    assert json.loads((repo / "metrics/prepare.json").read_text())["kept"] == 8

    # New conversations re-run prepare (and what follows it); the verifier record is still valid.
    write_jsonl(repo / "data/conversations/chats.jsonl", [{"conversations": chat}] * 12)
    again = dvc(["repro"], repo)
    assert "Stage 'verifier' didn't change, skipping" in again.stdout
    assert "Running stage 'prepare'" in again.stdout
    for stage in ("extract", "convert", "train", "free_sweep", "evaluate", "k_sweep"):
        assert f"Running stage '{stage}'" in again.stdout, stage
    assert json.loads((repo / "metrics/prepare.json").read_text())["kept"] == 12
    assert_all_skipped(dvc(["repro"], repo).stdout)

    # A fine-tune of the same shape copied over the same folder: the verifier stage, run again, sees other
    # weights, and every stage made with the old ones runs again; no regenerated reply is reused.
    weights = load_file(model / "model.safetensors")
    weights["model.layers.2.mlp.down_proj.weight"] += 0.01
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    old_fingerprint = json.loads((repo / "models/verifier/verifier.json").read_text())["fingerprint"]
    dvc(["repro", "-f", "verifier"], repo)
    assert json.loads((repo / "models/verifier/verifier.json").read_text())["fingerprint"] != old_fingerprint
    tuned = dvc(["repro"], repo)
    for stage in ("prepare", "extract", "convert", "train", "evaluate"):
        assert f"Running stage '{stage}'" in tuned.stdout, stage
    prepared = json.loads((repo / "metrics/prepare.json").read_text())
    assert prepared["regenerate_cache_hits"] == 0 and prepared["regenerated_turns"] == 12
    assert json.loads((repo / "metrics/extract.json").read_text())["rows_reused"] == 0

    # extract.store: online: extract writes a manifest, train computes the hidden states, evaluate follows;
    # prepare is not touched, and a second repro has nothing to do.
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["extract"]["store"] = "online"
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    draft_before = draft_hash(repo)
    online = dvc(["repro"], repo)
    assert "Stage 'prepare' didn't change, skipping" in online.stdout
    for stage in ("extract", "convert", "train"):
        assert f"Running stage '{stage}'" in online.stdout, stage
    # evaluate runs again unless online training reproduced the stored-file draft byte for byte (it does here)
    assert ("Running stage 'evaluate'" in online.stdout) != (draft_hash(repo) == draft_before)
    assert [p.name for p in (repo / "data/hidden_states").iterdir()] == ["manifest.json"]
    assert json.loads((repo / "metrics/train_details.json").read_text())["hidden_states"] == "online"
    assert json.loads((repo / "metrics/eval.json").read_text())["lossless"] == 1.0
    assert_all_skipped(dvc(["repro"], repo).stdout)


def test_bad_params_stop_dvc_repro_with_every_problem(tmp_path: Path, tiny_verifier_dir: Path):
    repo = make_pipeline_repo(
        tmp_path / "repo",
        {
            "verifier": {"model": str(tiny_verifier_dir), "aux_layers": [1, 1]},
            "prepare": {"max_len": 3, "shuffle": True},
        },
    )
    result = dvc(["repro"], repo, check=False)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    # a stage checks the sections it reads: the verifier stage names its own problem, not prepare's
    assert "eaglenest verifier: error: params.yaml: 1 invalid params value\n" in output
    assert "verifier.aux_layers = [1, 1]: layer ids must be distinct" in output
    assert "prepare." not in output
    assert "Traceback" not in output
    assert not (repo / "models/verifier").exists()
    # the whole-file check names every problem at once, before any stage runs
    params = yaml.safe_load((repo / "params.yaml").read_text())
    with pytest.raises(ParamsError) as info:
        parse_params(params)
    assert str(info.value).splitlines()[1:] == [
        "  - verifier.aux_layers = [1, 1]: layer ids must be distinct",
        "  - prepare.max_len = 3: Input should be greater than or equal to 16",
        "  - prepare.shuffle: unknown key (allowed: " + ", ".join(PrepareParams.model_fields) + ")",
    ]
    # and the prepare stage, when it runs, both of its own
    with pytest.raises(ParamsError) as info:
        parse_sections(params, PrepareStageParams)
    assert str(info.value).splitlines()[0] == "params.yaml: 2 invalid params values"


def test_malformed_conversations_stop_prepare_naming_file_and_record(tmp_path: Path, tiny_verifier_dir: Path):
    repo = make_pipeline_repo(
        tmp_path / "repo",
        {"verifier": {"model": str(tiny_verifier_dir)}, "prepare": {"source": ["data/conversations/bad.jsonl"]}},
    )
    (repo / "data/conversations/bad.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]}\n'
    )
    result = dvc(["repro"], repo, check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "eaglenest prepare: error: data/conversations/bad.jsonl: line 2: turn 1 has role 'bot'" in output
    assert "Traceback" not in output
    assert not (repo / "data/prepared").exists()


def changed_stages(repo: Path) -> set[str]:
    """The stages `dvc status` reports as changed."""
    return set(json.loads(dvc(["status", "--json"], repo).stdout or "{}"))


def _leaves(value: object) -> list:
    """Every number in a nested metrics document (what `dvc metrics show` counts)."""
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _leaves(item)]
    if isinstance(value, list):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def append_comment(path: Path) -> None:
    path.write_text(path.read_text() + "# an edit that changes nothing any stage computes\n")


@pytest.mark.slow
def test_an_edit_re_runs_only_the_stages_that_run_the_edited_code(tiny_pipeline: SharedPipeline, tmp_path: Path):
    """Each stage depends on exactly the code it runs: commands re-run nothing, the train package re-runs train
    (and evaluate and k_sweep only if the draft's bytes change), the hidden-state format the stages that read or
    write it."""
    repo = tiny_pipeline.copy(tmp_path / "repo")  # float32 on one process
    assert changed_stages(repo) == set()
    code = repo / "src" / "eaglenest"

    for command in ("report/__init__.py", "serve/__init__.py", "inspect.py", "cli.py", "importer.py", "doctor.py"):
        append_comment(code / "commands" / command)
    assert changed_stages(repo) == set()

    append_comment(code / "stages" / "train" / "optimization.py")
    assert changed_stages(repo) == {"train"}
    draft_before = draft_hash(repo)
    rerun = dvc(["repro"], repo)
    assert "Running stage 'train'" in rerun.stdout
    for stage in ("verifier", "prepare", "extract", "convert"):
        assert f"Stage '{stage}' didn't change, skipping" in rerun.stdout, stage
    # float32 on one process: the same data and seed give the same draft, byte for byte, so evaluate is skipped
    assert draft_hash(repo) == draft_before
    assert "Stage 'evaluate' didn't change, skipping" in rerun.stdout
    assert "Stage 'k_sweep' didn't change, skipping" in rerun.stdout
    assert "Stage 'free_sweep' didn't change, skipping" in rerun.stdout  # it reads no draft
    # the K record's format and rule: the stage that writes it and the plan that reads its K (serve and summary read
    # it too: commands re-run nothing)
    record_code = (code / "artifacts" / "k_record.py").read_text()
    append_comment(code / "artifacts" / "k_record.py")
    assert changed_stages(repo) == {"k_sweep", "plan"}
    (code / "artifacts" / "k_record.py").write_text(record_code)

    # the resume state of a running extraction is the extract stage's alone; the file format every reader's
    append_comment(code / "artifacts" / "hidden_states" / "resume.py")
    assert changed_stages(repo) == {"extract"}
    append_comment(code / "artifacts" / "hidden_states" / "format.py")
    assert changed_stages(repo) == {"extract", "convert", "train"}
