"""The hf extract back end: every layer slot checked against an independent computation, resumable."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglenest.artifacts.hidden_states.engines.contract import length_sorted_batches
from eaglenest.artifacts.hidden_states.extract_params import ExtractParams
from eaglenest.artifacts.hidden_states.format import check_header, hs_path
from eaglenest.artifacts.hidden_states.layout import ShardSpec, file_layout
from eaglenest.artifacts.hidden_states.resume import unfinished_dir
from eaglenest.artifacts.prepared import load_split
from eaglenest.commands.params_file import parse_params
from eaglenest.core.errors import EaglenestError, ParamsError
from eaglenest.core.lock import lock_file_for
from eaglenest.stages.extract import extract_hidden_states, job
from eaglenest.stages.extract.job import row_tasks
from tests.fixtures.lock import held_by_another_process
from tests.fixtures.models import build_tiny_tokenizer, build_tiny_verifier
from tests.fixtures.pipeline import pipeline_until_prepare, stored_row


def build_tiny_qwen3(path: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(1)
    Qwen3ForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def reference_hidden_states(model_dir: Path, input_ids: list[int], layer_ids: list[int]) -> torch.Tensor:
    """Independently of the hooks: one unpadded row through the full causal LM with output_hidden_states.

    transformers' hidden_states[L] for L < N is the residual stream after L layers; its last entry is
    *after* the final norm, so slot N is checked as norm(slot N) == hidden_states[N] instead.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([input_ids]), output_hidden_states=True)
    return torch.stack([out.hidden_states[layer][0] for layer in layer_ids], dim=1), model


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_every_slot_matches_an_independent_computation(tmp_path: Path, architecture: str):
    model_dir = build_tiny_verifier(tmp_path / "m") if architecture == "llama" else build_tiny_qwen3(tmp_path / "m")
    verifier_dir, prepared = pipeline_until_prepare(tmp_path, model_dir)
    out = tmp_path / "data" / "hidden_states"
    # Small batches force padding: rows of different lengths share a batch.
    metrics = extract_hidden_states(
        ExtractParams(dtype="float32", batch_tokens=200),
        verifier_dir,
        prepared,
        out,
        tmp_path / "metrics" / "extract.json",
    )
    from datasets import load_from_disk

    dataset = load_from_disk(str(prepared))
    assert metrics["rows"] == len(dataset) == metrics["rows_computed"]
    for row in range(len(dataset)):
        ids = dataset[row]["input_ids"].tolist()
        stored = stored_row(out, row)
        assert stored["token_ids"].tolist() == ids and stored["token_ids"].dtype == torch.int64
        hs = stored["hidden_states"]
        assert hs.shape == (len(ids), 4, 32) and hs.dtype == torch.float32
        expected_aux, model = reference_hidden_states(model_dir, ids, [1, 3, 5])
        torch.testing.assert_close(hs[:, :3], expected_aux, rtol=1e-4, atol=1e-5)
        with torch.no_grad():
            final = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[8][0]
            torch.testing.assert_close(model.model.norm(hs[:, 3]), final, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(hs[:, 3], final)  # slot N really is pre-norm


def test_speculators_reads_the_files(tmp_path: Path, tiny_verifier_dir: Path):
    from hs_connectors import FileTransfer
    from speculators.data_generation.offline import check_hidden_states
    from speculators.train.data import ArrowDataset, CollateFn

    verifier_dir, prepared = pipeline_until_prepare(tmp_path, tiny_verifier_dir)
    out = tmp_path / "data" / "hidden_states"
    extract_hidden_states(ExtractParams(rows_per_shard=1), verifier_dir, prepared, out, tmp_path / "extract.json")
    split = load_split(prepared)
    dataset = ArrowDataset(
        max_len=256,
        datapath=prepared,
        transfer=FileTransfer(out),
        on_missing="raise",
        train_ratio=split["train_ratio"],
        split="train",
    )
    for index in range(len(dataset)):
        row = dataset.data.with_format(None)[index]
        check_hidden_states(load_file(hs_path(out, index)), row["input_ids"])
    collate = CollateFn(max_len=256, hidden_size=32, num_target_layers=3)
    batch = collate([dataset[0], dataset[1]])
    assert batch["hidden_states"].shape == (1, 256, 3 * 32)
    assert batch["verifier_last_hidden_states"].shape == (1, 256, 32)
    packed = int(dataset[0]["lengths"] + dataset[1]["lengths"])
    assert int((batch["document_ids"] >= 0).sum()) == packed  # both rows packed, the rest padding
    assert batch["error_records"] == 0


def test_resume_recomputes_only_bad_or_missing_files(tmp_path: Path, tiny_verifier_dir: Path):
    verifier_dir, prepared = pipeline_until_prepare(tmp_path, tiny_verifier_dir)
    out = tmp_path / "hs"
    params = ExtractParams(rows_per_shard=1)  # row files: each is broken its own way below
    extract_hidden_states(params, verifier_dir, prepared, out, tmp_path / "m.json")
    reference = {p.name: p.read_bytes() for p in out.iterdir()}
    untouched = hs_path(out, 5)
    mtime = untouched.stat().st_mtime_ns

    data = hs_path(out, 0).read_bytes()
    hs_path(out, 0).write_bytes(data[: len(data) // 2])  # truncated
    hs_path(out, 1).unlink()  # missing
    hs_path(out, 2).write_bytes(b"")  # zero bytes
    tensors = load_file(hs_path(out, 3))
    tensors["token_ids"][0] += 1
    save_file(tensors, hs_path(out, 3), metadata={"eaglenest": '{"config": "other"}'})  # foreign + wrong tokens
    (out / f".hs_4.safetensors.tmp-{os.getpid() + 1}").write_bytes(b"half")  # a killed writer's leftover
    hs_path(out, 99).write_bytes(b"stale")  # a row that no longer exists

    metrics = extract_hidden_states(params, verifier_dir, prepared, out, tmp_path / "m.json")
    assert metrics["rows_computed"] == 4 and metrics["rows_reused"] == metrics["rows"] - 4
    assert {p.name: p.read_bytes() for p in out.iterdir()} == reference  # bit-identical, nothing else left
    assert untouched.stat().st_mtime_ns == mtime

    again = extract_hidden_states(params, verifier_dir, prepared, out, tmp_path / "m.json")
    assert again["rows_computed"] == 0 and again["tokens_per_s"] is None


def test_a_second_extraction_into_the_folder_is_refused_and_leaves_the_first_alone(
    tmp_path: Path, tiny_verifier_dir: Path
):
    """Two extract stages of one workspace (``python stages/extract.py`` beside a ``dvc repro``): the second meets
    the first's lock on the unfinished folder before it looks at, moves or deletes any file there."""
    verifier_dir, prepared = pipeline_until_prepare(tmp_path, tiny_verifier_dir)
    out = tmp_path / "hs"
    unfinished = unfinished_dir(out)
    unfinished.mkdir(parents=True)
    first = {
        "hs_0.safetensors": b"a file the first extraction finished",
        f".hs_1.safetensors.tmp-{os.getpid() + 1}": b"a file the first extraction is writing",
    }
    for name, data in first.items():
        (unfinished / name).write_bytes(data)
    with held_by_another_process(lock_file_for(unfinished)) as pid, pytest.raises(EaglenestError) as info:
        extract_hidden_states(ExtractParams(rows_per_shard=1), verifier_dir, prepared, out, tmp_path / "m.json")
    assert str(info.value) == (
        f"{unfinished} is being written by pid {pid} on {socket.gethostname()} (lock "
        f"{lock_file_for(unfinished)}): wait for it to finish or stop it, then run again"
    )
    assert {p.name: p.read_bytes() for p in unfinished.iterdir()} == first
    assert not out.exists() and not (tmp_path / "m.json").exists()


def test_changed_dtype_recomputes_everything(tmp_path: Path, tiny_verifier_dir: Path, caplog: pytest.LogCaptureFixture):
    verifier_dir, prepared = pipeline_until_prepare(tmp_path, tiny_verifier_dir)
    out = tmp_path / "hs"
    first = extract_hidden_states(
        ExtractParams(dtype="bfloat16", rows_per_shard=1), verifier_dir, prepared, out, tmp_path / "m.json"
    )
    # the host record names what the decoder computed in: float32 on a CPU, whatever is stored (a GPU's bf16 is
    # checked in test_extract_cuda.py)
    assert first["host"]["compute_dtype"] == "float32" and first["dtype"] == "bfloat16"
    with caplog.at_level("INFO", logger="eaglenest"):
        metrics = extract_hidden_states(
            ExtractParams(dtype="float32", rows_per_shard=1), verifier_dir, prepared, out, tmp_path / "m.json"
        )
    assert metrics["rows_computed"] == metrics["rows"] == 10
    # three files named, the rest counted: one line per reason, not one per file
    recomputing = [r.getMessage() for r in caplog.records if r.getMessage().startswith("recomputing")]
    assert len(recomputing) == 4
    assert recomputing[-1] == "recomputing 10 files in all: hidden_states dtype BF16, expected F32 (float32)"
    assert (
        check_header(
            hs_path(out, 0),
            seq_len=load_file(hs_path(out, 0))["token_ids"].numel(),
            num_slots=4,
            hidden_size=32,
            dtype="float32",
        )
        is None
    )
    written = json.loads((tmp_path / "m.json").read_text())
    assert written["dtype"] == "float32" and written["bytes_per_token"] == pytest.approx(4 * 32 * 4 + 8, rel=0.2)


def test_row_longer_than_context_is_refused_with_its_index(tmp_path: Path):
    model = build_tiny_verifier(tmp_path / "m")
    config_file = model / "config.json"
    config = json.loads(config_file.read_text())
    config["max_position_embeddings"] = 20
    config_file.write_text(json.dumps(config))
    verifier_dir, prepared = pipeline_until_prepare(tmp_path, model)
    with pytest.raises(
        EaglenestError,
        match=r"prepared row \d+ has \d+ tokens, more than the verifier's context "
        r"of 20 .*set prepare.max_len <= 20",
    ):
        extract_hidden_states(ExtractParams(), verifier_dir, prepared, tmp_path / "hs", tmp_path / "m.json")


def test_a_token_outside_the_vocabulary_is_refused_before_any_work(tmp_path: Path, tiny_verifier_dir: Path):
    """Prepared with another tokenizer: one line naming the row, not an index error from inside torch."""
    from eaglenest.artifacts.prepared import write_prepared

    verifier_dir, _ = pipeline_until_prepare(tmp_path, tiny_verifier_dir)
    prepared = tmp_path / "other"
    write_prepared(prepared, [[5, 6, 7], [8, 4000, 9]], [[0, 1, 1], [0, 1, 1]], 1, [])
    with pytest.raises(
        EaglenestError,
        match=r"^prepared row 1 holds token id 4000, outside the verifier's vocabulary "
        r"of \d+ \(1 rows in all\); was data/prepared written with another "
        r"tokenizer\? `dvc repro prepare`$",
    ):
        extract_hidden_states(ExtractParams(), verifier_dir, prepared, tmp_path / "hs", tmp_path / "m.json")
    assert not (tmp_path / "hs").exists()


def test_batches_are_length_sorted_and_bounded():
    lengths = [5, 50, 7, 48, 300, 6]
    batches = length_sorted_batches(list(range(6)), lengths, batch_tokens=100)
    assert batches[0] == [4]  # longer than the budget: alone
    assert sorted(sum(batches, [])) == list(range(6))
    for batch in batches[1:]:
        assert len(batch) * max(lengths[r] for r in batch) <= 100


def test_consecutive_whole_batches_are_packed_again_into_the_same_batches():
    """What cutting a shard into tasks rests on: the rows of any run of a shard's length-sorted batches, batched on
    their own, fall into the very same batches (so a row's padding and batch shape, hence its bytes, stay)."""
    rng = random.Random(0)
    for _ in range(50):
        lengths = {row: rng.randrange(1, 120) for row in range(rng.randrange(1, 80))}
        budget = rng.randrange(16, 400)
        batches = length_sorted_batches(list(lengths), lengths, budget)
        for first in range(len(batches)):
            for last in range(first + 1, len(batches) + 1):
                rows = [row for batch in batches[first:last] for row in batch]
                rng.shuffle(rows)
                assert length_sorted_batches(rows, lengths, budget) == batches[first:last]


def test_a_shard_is_cut_into_tasks_of_whole_batches(monkeypatch: pytest.MonkeyPatch):
    rng = random.Random(1)
    spec = ShardSpec(2, range(60, 90), 30)
    input_ids = [[5] * rng.randrange(1, 50) for _ in spec.rows]
    layout = file_layout(spec, input_ids, 4, 8, "bfloat16", {})
    monkeypatch.setattr(job, "ROWS_PER_TASK", 7)
    params = ExtractParams(batch_tokens=100)
    tasks = row_tasks(layout, params)
    batches = length_sorted_batches(
        list(spec.rows), {row: len(ids) for row, ids in zip(spec.rows, input_ids, strict=True)}, 100
    )
    assert sorted(row for task in tasks for row in task.rows) == list(spec.rows)
    for task in tasks:
        assert all(len(ids) == len(input_ids[row - 60]) for row, ids in zip(task.rows, task.input_ids, strict=True))
        assert [batch for batch in batches if set(batch) & set(task.rows)] == length_sorted_batches(
            list(task.rows), {row: len(input_ids[row - 60]) for row in task.rows}, 100
        )  # whole batches of the shard's plan
    assert all(len(task.rows) >= 7 for task in tasks[:-1]) and len(tasks) > 1
    assert tasks[1].label == f"shard 2 (rows 60..89), task 2 of {len(tasks)}" and tasks[0].row_shape == (4, 8)
    vllm = row_tasks(layout, ExtractParams(backend="vllm", batch_tokens=100))  # consecutive rows
    assert [task.rows for task in vllm] == [tuple(range(start, min(start + 7, 90))) for start in range(60, 90, 7)]


def folder_bytes(path: Path) -> dict[str, bytes]:
    return {file.name: file.read_bytes() for file in sorted(path.iterdir())}


def test_a_shard_computed_in_several_tasks_is_its_whole_computation(
    tmp_path: Path, tiny_verifier_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    """Bit for bit: shards of 8 rows in several batches, cut into tasks of 2 rows at least, and each in one task."""
    verifier_dir, prepared = pipeline_until_prepare(tmp_path, tiny_verifier_dir)
    params = ExtractParams(rows_per_shard=8, batch_tokens=64)
    monkeypatch.setattr(job, "ROWS_PER_TASK", 10**6)
    with caplog.at_level("INFO", logger="eaglenest"):
        extract_hidden_states(params, verifier_dir, prepared, tmp_path / "whole", tmp_path / "whole.json")
    assert "2 files to compute in 2 tasks (local executor)" in caplog.text
    monkeypatch.setattr(job, "ROWS_PER_TASK", 2)
    caplog.clear()
    with caplog.at_level("INFO", logger="eaglenest"):
        metrics = extract_hidden_states(params, verifier_dir, prepared, tmp_path / "cut", tmp_path / "cut.json")
    tasks = int(caplog.text.split("2 files to compute in ")[1].split(" tasks")[0])
    assert tasks >= 4 and metrics["rows_computed"] == 10
    assert folder_bytes(tmp_path / "cut") == folder_bytes(tmp_path / "whole")


KILLED_MID_SHARD = """
import os, signal, sys
from pathlib import Path
import eaglenest.stages.extract as stage
from eaglenest.stages.extract import job
from eaglenest.artifacts.hidden_states.extract_params import ExtractParams

job.ROWS_PER_TASK = 1

def run_then_die(engine, task):
    if (task.spec.number, task.part) == (1, 1):  # shard 0 is finished, shard 1 has its first task's rows
        os.kill(os.getpid(), signal.SIGKILL)
    return job.run_row_task(engine, task)

stage.run_row_task = run_then_die
root = Path(sys.argv[1])
params = ExtractParams(rows_per_shard=4, batch_tokens=16)
stage.extract_hidden_states(params, root / "verifier", root / "prepared", root / "hs", root / "m.json")
"""


def test_a_run_killed_mid_shard_computes_that_shard_again(tmp_path: Path, tiny_verifier_dir: Path):
    verifier_dir, prepared = pipeline_until_prepare(tmp_path, tiny_verifier_dir)
    params = ExtractParams(rows_per_shard=4, batch_tokens=16)
    extract_hidden_states(params, verifier_dir, prepared, tmp_path / "reference", tmp_path / "reference.json")
    (tmp_path / "verifier").symlink_to(verifier_dir)
    (tmp_path / "prepared").symlink_to(prepared)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_SHARD, str(tmp_path)], env=env, capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    unfinished = unfinished_dir(tmp_path / "hs")
    left = sorted(path.name for path in unfinished.iterdir() if path.is_file())
    # shard 0 finished; shard 1 only as the temporary its first task's rows went into
    assert left[0].startswith(".shard_1.safetensors.tmp-") and left[1:] == ["shard_0.safetensors"]
    metrics = extract_hidden_states(params, verifier_dir, prepared, tmp_path / "hs", tmp_path / "m.json")
    assert metrics["rows_computed"] == 6  # shards 1 and 2: shard 1's rows computed again
    assert folder_bytes(tmp_path / "hs") == folder_bytes(tmp_path / "reference")


def test_bad_flag_combinations_are_refused():
    with pytest.raises(ParamsError) as info:
        parse_params({"extract": {"backend": "hf", "vllm": {"tensor_parallel_size": 2}, "rank": 2, "world_size": 2}})
    text = str(info.value)
    # the static parts of multi-node extraction are gone: the keys say what replaced them
    assert "extract.world_size: removed; use cluster.executor: ray, which shares the shards over the nodes" in text
    assert "extract.rank: removed; use cluster.executor: ray" in text
    assert "extract.vllm.tensor_parallel_size = 2 needs extract.backend: vllm" in text
    with pytest.raises(ParamsError, match=r"extract.backend: import needs extract.import_path"):
        parse_params({"extract": {"backend": "import"}})
    with pytest.raises(ParamsError, match=r"extract.import_path = 'x' is only read by extract.backend: import"):
        parse_params({"extract": {"import_path": "x"}})


def test_the_host_record_names_the_dtype_the_verifier_computed_in(tmp_path: Path):
    """vllm: the engine's dtype, "auto" resolved as vLLM is asked for it, whatever extract.dtype stores; import: none,
    the states were computed elsewhere (hf's is checked above, on the real decoder)."""
    from eaglenest.core.vllm_support import serving_dtype
    from eaglenest.stages.extract import computed_in

    checkpoint = tmp_path / "verifier"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"dtype": "float32"}))
    vllm = {"backend": "vllm", "dtype": "bfloat16"}
    assert computed_in(ExtractParams(**vllm, vllm={"dtype": "float32"}), checkpoint) == "float32"
    # an fp32 checkpoint: bf16 where this host computes it natively, else float32 (what the engine is started with)
    assert computed_in(ExtractParams(**vllm), checkpoint) == serving_dtype(checkpoint) in ("bfloat16", "float32")
    (checkpoint / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    assert computed_in(ExtractParams(**vllm), checkpoint) == "float16"
    assert computed_in(ExtractParams(backend="import", import_path=str(tmp_path)), checkpoint) is None
