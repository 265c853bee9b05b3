"""Faults and bad input: kills, failed writes, corrupt files, random params — nothing is lost or trusted."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import eaglenest.core.atomic as atomic
from eaglenest.artifacts.hidden_states.format import stored_files
from eaglenest.artifacts.hidden_states.resume import unfinished_dir
from eaglenest.artifacts.vocab import load_vocab
from eaglenest.commands.params_file import Params, parse_params
from eaglenest.core.atomic import ASIDE_MARKER, TMP_MARKER, atomic_write_bytes
from eaglenest.core.errors import EaglenestError, InputFileError, ParamsError
from tests.fixtures.pipeline import VENV_BIN, SharedPipeline, dvc, project_env, read_curves, run

# ---------------------------------------------------------------------------------------------- network


@pytest.mark.skipif(not os.environ.get("EAGLENEST_NETWORK_BLOCKED"), reason="not run through scripts/offline.sh")
def test_the_suite_runs_with_outbound_network_blocked():
    probe = socket.socket()
    probe.settimeout(2)
    assert probe.connect_ex(("1.1.1.1", 443)) != 0


# ----------------------------------------------------------------------------------------------- params

VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 100_000),
    st.floats(-2, 2),
    st.just(float("nan")),
    st.text(max_size=8),
    st.lists(st.integers(-3, 40), max_size=4),
)


@st.composite
def params_files(draw):
    raw = {}
    for section, model in Params.model_fields.items():
        if draw(st.booleans()):
            continue
        fields = list(model.annotation.model_fields)
        chosen = draw(st.lists(st.sampled_from(fields + ["bogus_key"]), max_size=4, unique=True))
        raw[section] = {key: draw(VALUES) for key in chosen}
    if draw(st.booleans()):
        raw["not_a_stage"] = {}
    return raw


def _problem_lines(raw: dict) -> list[str]:
    """The problem lines parse_params reports for ``raw`` (none when it validates)."""
    try:
        parse_params(raw)
    except ParamsError as err:
        return [line.strip().removeprefix("- ") for line in str(err).splitlines()[1:]]
    return []


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params_files())
def test_random_params_either_validate_or_name_every_bad_key(raw):
    try:
        parse_params(raw)
    except ParamsError as err:
        message = str(err)
    else:
        return
    assert "Traceback" not in message
    for section, values in raw.items():
        if section not in Params.model_fields:
            assert f"{section}: unknown key" in message
            continue
        model = Params.model_fields[section].annotation
        defaults = {name: f.get_default(call_default_factory=True) for name, f in model.model_fields.items()}

        def combinations(values: dict, model=model, defaults=defaults) -> list[str]:
            check = getattr(model, "consistency_problems", None)
            return check({**defaults, **values}) if check is not None else []

        # A bad combination of this section's values is reported, line for line.
        for line in combinations(values):
            assert line in message, (section, line, message)
        for key, value in values.items():
            # A value bad by itself (not only next to the defaults of other keys) is named, whatever else is wrong.
            alone = _problem_lines({section: {key: value}})
            if any(line not in combinations({key: value}) for line in alone):
                assert f"{section}.{key}" in message, (section, key, alone, message)


# ------------------------------------------------------------------------------------------ failed writes


def test_disk_full_leaves_nothing_under_the_final_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    class FullDisk:
        def __init__(self, path, mode):
            self.file = open(path, mode)  # noqa: SIM115

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic, "open", FullDisk, raising=False)
    with pytest.raises(EaglenestError, match=r"could not write .*out.bin: No space left on device"):
        atomic_write_bytes(tmp_path / "out.bin", b"data")
    assert list(tmp_path.iterdir()) == []


def test_read_only_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(atomic, "open", denied, raising=False)
    with pytest.raises(EaglenestError, match=r"could not write .*out.json: Permission denied"):
        atomic.atomic_write_json(tmp_path / "out.json", {"a": 1})
    assert not (tmp_path / "out.json").exists()


def test_disk_full_during_extraction_then_rerun(
    tmp_path: Path, tiny_verifier_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    """The disk fills up while shard 3 is written: one line naming it, no temporary left, shards 0-2 kept for the
    rerun, which computes only the rest."""
    from eaglenest.artifacts.hidden_states import layout
    from eaglenest.artifacts.hidden_states.extract_params import ExtractParams
    from eaglenest.artifacts.hidden_states.resume import unfinished_dir
    from eaglenest.stages.extract import extract_hidden_states
    from tests.fixtures.pipeline import pipeline_until_prepare

    verifier_dir, prepared = pipeline_until_prepare(tmp_path, tiny_verifier_dir, rows=10)
    real_pwrite, writes = os.pwrite, {"n": 0}
    per_shard = 6  # header, token ids, row index, 2 rows' hidden states, then the checksum into the header

    def fills_up(fd, data, offset):
        # os.pwrite is the module's own: the extraction folder's lock file writes through it too, and is not a shard
        writes["n"] += "shard_" in os.readlink(f"/proc/self/fd/{fd}")
        if writes["n"] > 3 * per_shard:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(layout.os, "pwrite", fills_up)
    out = tmp_path / "hs"
    params = ExtractParams(batch_tokens=32, rows_per_shard=2)
    with pytest.raises(
        EaglenestError,
        match=r"^could not write .*hs.unfinished/shard_3.safetensors: No space left on "
        r"device \(nothing was left under that name\)$",
    ):
        extract_hidden_states(params, verifier_dir, prepared, out, tmp_path / "m.json")
    unfinished = unfinished_dir(out)
    assert sorted(p.name for p in unfinished.iterdir()) == ["earlier", *[f"shard_{s}.safetensors" for s in range(3)]]
    assert not [p for p in unfinished.rglob("*") if TMP_MARKER in p.name] and not list(out.iterdir())
    monkeypatch.undo()
    metrics = extract_hidden_states(params, verifier_dir, prepared, out, tmp_path / "m.json")
    assert metrics["rows_reused"] == 6 and metrics["rows_computed"] == 4 and not unfinished.exists()


def test_out_of_memory_says_which_param_to_lower(
    tmp_path: Path, tiny_verifier_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    import eaglenest.core.decoder as decoder
    from eaglenest.artifacts.hidden_states.extract_params import ExtractParams
    from eaglenest.stages.extract import extract_hidden_states
    from tests.fixtures.pipeline import pipeline_until_prepare

    verifier_dir, prepared = pipeline_until_prepare(tmp_path, tiny_verifier_dir, rows=4)

    def out_of_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(decoder, "forward_hidden_states", out_of_memory)
    with pytest.raises(EaglenestError, match=r"out of memory on cpu .* lower extract.batch_tokens \(now 8192\)"):
        extract_hidden_states(
            ExtractParams(batch_tokens=8192), verifier_dir, prepared, tmp_path / "hs", tmp_path / "m.json"
        )
    with pytest.raises(
        EaglenestError, match=r"out of memory on cpu .*; a row alone does not fit \(extract.batch_tokens: 0\)"
    ):
        extract_hidden_states(
            ExtractParams(batch_tokens=0), verifier_dir, prepared, tmp_path / "hs", tmp_path / "m.json"
        )


# ------------------------------------------------------------------------------------ corrupt artefacts


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_verifier_dir: Path) -> dict[str, Path]:
    from eaglenest.artifacts.hidden_states.extract_params import ExtractParams
    from eaglenest.stages.convert import convert
    from eaglenest.stages.convert.params import ConvertParams
    from eaglenest.stages.extract import extract_hidden_states
    from eaglenest.stages.train import TrainPaths, train_draft
    from eaglenest.stages.train.params import TrainParams
    from tests.fixtures.pipeline import pipeline_until_prepare

    root = tmp_path_factory.mktemp("faults")
    verifier_dir, prepared = pipeline_until_prepare(root, tiny_verifier_dir, rows=12)
    extract_hidden_states(ExtractParams(), verifier_dir, prepared, root / "hs", root / "e.json")
    convert(
        ConvertParams(draft_vocab_size=64),
        ExtractParams(dtype="bfloat16"),
        verifier_dir,
        prepared,
        root / "hs",
        root / "vocab",
        root / "d.json",
    )
    train_draft(
        TrainParams(steps=2, eval_every=2, total_seq_len=256),
        TrainPaths(
            verifier=verifier_dir,
            prepared=prepared,
            hidden_states=root / "hs",
            vocab=root / "vocab",
            out=root / "draft",
            metrics=root / "t.json",
            details=root / "t_details.json",
            live_dir=root / "live",
            checkpoints=root / "ck",
        ),
    )
    return {
        "root": root,
        "verifier": verifier_dir,
        "prepared": prepared,
        "vocab": root / "vocab",
        "draft": root / "draft",
        "model": tiny_verifier_dir,
    }


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("garbage", r"d2t-64.npy: not a readable .npy file"),
        ("wrong dtype", r"d2t-64.npy: int32 \[64\], expected int64 \[64\]"),
        ("disagree", r"d2t-64.npy and t2d-64.npy disagree"),
        ("pickled", r"d2t-64.npy: not a readable .npy file"),
    ],
)
def test_corrupt_vocabulary_files(trained: dict[str, Path], tmp_path: Path, damage: str, message: str):
    import shutil

    vocab = tmp_path / "vocab"
    shutil.copytree(trained["vocab"], vocab)
    d2t = vocab / "d2t-64.npy"
    if damage == "garbage":
        d2t.write_bytes(b"\x93NUMPY garbage")
    elif damage == "wrong dtype":
        np.save(d2t, np.load(d2t).astype(np.int32))
    elif damage == "disagree":
        values = np.load(d2t)
        values[3] += 1
        np.save(d2t, values)
    else:
        np.save(d2t, np.array([{"evil": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(InputFileError, match=message):
        load_vocab(vocab)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("missing tensor", r"model.safetensors: missing tensor fc.weight \[32, 96\]"),
        ("wrong shape", r"model.safetensors: tensor fc.weight has shape \[32, 64\], expected \[32, 96\]"),
        ("truncated", r"model.safetensors: truncated"),
    ],
)
def test_corrupt_draft_checkpoint(trained: dict[str, Path], tmp_path: Path, damage: str, message: str):
    import shutil

    from eaglenest.artifacts.draft import load_draft

    draft = tmp_path / "draft"
    shutil.copytree(trained["draft"], draft)
    weights = draft / "model.safetensors"
    tensors = load_file(weights)
    if damage == "missing tensor":
        del tensors["fc.weight"]
        save_file(tensors, weights)
    elif damage == "wrong shape":
        tensors["fc.weight"] = tensors["fc.weight"][:, :64].contiguous()
        save_file(tensors, weights)
    else:
        weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(InputFileError, match=message):
        load_draft(draft, trained["model"])


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"messages": [{"role": "user", "content": "hi"}]}\n{oops\n', r"prompts.jsonl: line 2: not valid JSON"),
        ('{"text": "hi"}\n', r"prompts.jsonl: line 1: expected \{'messages': \[..., user message\]\}, \{'prompt'"),
        ('{"turns": []}\n', r"prompts.jsonl: line 1: expected"),
        ("", r"prompts.jsonl: no prompts"),
    ],
)
def test_bad_set_file_is_one_line_naming_the_set_and_the_file(
    trained: dict[str, Path], tmp_path: Path, content: str, message: str
):
    from eaglenest.artifacts.eval_params import EvalSetParams
    from eaglenest.artifacts.eval_sets import load_eval_set
    from eaglenest.artifacts.verifier import load_tokenizer

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(content)
    with pytest.raises(InputFileError, match="^evaluate.sets: mine: .*" + message) as raised:
        load_eval_set(
            EvalSetParams(name="mine", source=str(prompts)), trained["prepared"], load_tokenizer(trained["verifier"])
        )
    assert "\n" not in str(raised.value)


# ------------------------------------------------------------------------------------------------- kills


def kill_during(repo: Path, stage: str, ready, rng: random.Random) -> bool:
    """Starts `dvc repro STAGE`, waits until ``ready()`` (work has begun), then kill -9s it after a random delay.

    Returns False when the stage finished before the kill landed (nothing was interrupted).
    """
    # The stage must run, never be restored: every output is in DVC's cache, so with its dependencies unchanged
    # `dvc repro` would check the locked outputs out instead (-f -s: this stage, run), or take the run-cache's.
    process = subprocess.Popen(
        [str(VENV_BIN / "dvc"), "repro", "-f", "-s", "--no-run-cache", stage],
        cwd=repo,
        env=project_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None and not ready():
        time.sleep(0.01)
    time.sleep(rng.uniform(0.0, 0.15))
    if process.poll() is not None:
        return False
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended between the poll and the kill
        process.wait()
        return False
    process.wait()
    return True


def kill_five_times(repo: Path, stage: str, ready_factory, reset, rng: random.Random) -> None:
    """Five kills that really interrupted the stage; a run that finished first is reset and retried."""
    kills = attempts = 0
    while kills < 5:
        attempts += 1
        assert attempts <= 15, f"only {kills} kills landed in {attempts} attempts"
        if kill_during(repo, stage, ready_factory(), rng):
            kills += 1
        else:
            reset()


def no_temporaries(*folders: Path) -> bool:
    """No temporary, nor a folder set aside by a swap, is left in ``folders``."""
    return not [
        p
        for folder in folders
        if folder.exists()
        for p in folder.rglob("*")
        if TMP_MARKER in p.name or ASIDE_MARKER in p.name
    ]


@pytest.mark.slow
def test_kill_9_during_extract_and_train_five_times_each(tiny_pipeline: SharedPipeline, tmp_path: Path):
    repo = tiny_pipeline.copy(tmp_path / "repo")  # the shared run is the uninterrupted reference
    hs_dir, draft = repo / "data/hidden_states", repo / "models/draft"
    reference_hs = {p.name: p.read_bytes() for p in hs_dir.iterdir()}
    assert len(reference_hs) > 4 and all(name.startswith("shard_") for name in reference_hs)
    reference_draft = load_file(draft / "model.safetensors")
    reference_curves = read_curves(repo / "dvclive/train")
    rng = random.Random(1234)

    import shutil

    shutil.rmtree(hs_dir)  # extract again from an empty folder, killed 5 times

    def finished_shards() -> int:  # waiting in the unfinished folder, or moved into the output at the end
        return len(stored_files(hs_dir)) + len(stored_files(unfinished_dir(hs_dir)))

    def new_hidden_state_file():  # a shard finished since the stage started
        before = finished_shards()
        return lambda: finished_shards() > before

    def fewer_hidden_states():  # a run finished uninterrupted: take half the shards away and go on
        for path in stored_files(hs_dir)[::2]:
            path.unlink()

    kill_five_times(repo, "extract", new_hidden_state_file, fewer_hidden_states, rng)
    dvc(["repro", "-f", "-s", "extract"], repo)  # resumes from the finished shards (forced: see kill_during)
    assert {p.name: p.read_bytes() for p in hs_dir.iterdir()} == reference_hs  # bit-identical, nothing extra
    assert not unfinished_dir(hs_dir).exists()

    checkpoints = repo / ".eaglenest/train-checkpoints"
    shutil.rmtree(draft)  # train again, killed 5 times, each time after a newer checkpoint was written

    def newer_checkpoint():
        started = time.time()
        return lambda: any(p.stat().st_mtime > started for p in checkpoints.rglob("checkpoint.pt"))

    def retrain():  # a run finished uninterrupted: drop the draft so the next `dvc repro` trains again
        shutil.rmtree(draft, ignore_errors=True)

    kill_five_times(repo, "train", newer_checkpoint, retrain, rng)
    final = dvc(["repro", "-f", "-s", "--no-run-cache", "train"], repo)
    assert "Running stage 'train'" in final.stdout
    resumed = json.loads((repo / "metrics/train_details.json").read_text())
    assert resumed["resumed_from_step"] > 0
    weights = load_file(draft / "model.safetensors")
    for name, tensor in reference_draft.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-4, atol=1e-5)
    # DVC deleted dvclive/train before each run; the resumed run wrote back what its checkpoint kept
    assert read_curves(repo / "dvclive/train") == reference_curves
    assert no_temporaries(hs_dir, draft, repo / "data", repo / "models")
    assert not any(checkpoints.rglob("checkpoint.pt"))  # removed once the draft was written


# ------------------------------------------------------------------------------------------ two runs at once
# The stage starts, then waits for the test to say "go" (at most a minute): the second run meets the first mid-stage.
WAITING_STAGE = (
    "import pathlib, time\n"
    "pathlib.Path('started').write_text('')\n"
    "deadline = time.monotonic() + 60\n"
    "while not pathlib.Path('go').exists() and time.monotonic() < deadline:\n"
    "    time.sleep(0.05)\n"
    "pathlib.Path('out.txt').write_text('done')\n"
)


def test_a_second_dvc_repro_in_one_workspace_is_refused_while_the_first_runs(tmp_path: Path):
    """DVC 3 releases its repository lock (.dvc/tmp/lock) while a stage's command runs and holds the stage's outputs
    in .dvc/tmp/rwlock instead: a second ``dvc repro`` gets the repository lock, meets the outputs' lock, and stops
    naming the first run's pid. (Met while the first holds the repository lock, it retries for 3 s and stops with
    "Unable to acquire lock"; refused either way.)"""
    repo = tmp_path / "repo"
    repo.mkdir()
    run(["git", "init", "-q"], repo)
    dvc(["init", "-q"], repo)
    dvc(["config", "core.analytics", "false"], repo)
    (repo / "stage.py").write_text(WAITING_STAGE)
    (repo / "dvc.yaml").write_text(
        "stages:\n  wait:\n    cmd: python stage.py\n    deps: [stage.py]\n    outs: [out.txt]\n"
    )
    first = subprocess.Popen(
        [str(VENV_BIN / "dvc"), "repro"],
        cwd=repo,
        env=project_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (repo / "started").exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (repo / "started").exists(), "the first run's stage never started"
        second = dvc(["repro"], repo, check=False)
        (repo / "go").write_text("")
        first_output, _ = first.communicate(timeout=60)
    finally:
        first.kill()
        first.wait()
    assert second.returncode != 0 and "Running stage" not in second.stdout
    assert (
        f"failed to reproduce 'wait': '{repo / 'out.txt'}' is busy, it is being blocked by:\n  (PID {first.pid})"
        in second.stderr
    )
    assert first.returncode == 0, first_output
    assert (repo / "out.txt").read_text() == "done"
    assert "up to date" in dvc(["status"], repo).stdout
