"""`eaglenest init`: a params.yaml for a new verifier, with each choice made for it explained, that the strict
check accepts and the verifier stage runs; a folder that is not a model is refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from eaglenest.commands import cli
from eaglenest.commands.init import Gpus, VerifierFacts, choose, init_aux_layers, tensor_parallel
from eaglenest.commands.params_file import load_params
from eaglenest.stages.verifier import build_verifier
from tests.fixtures.models import QWEN3_LIKE, build_tiny_verifier, build_verifier_folder
from tests.fixtures.pipeline import REPO


def _init(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["init", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _commented(text: str) -> dict[str, str]:
    """``{key: comment}`` of every line of params.yaml that carries a comment after its value."""
    return {
        line.split(":")[0].strip(): line.split("  # ", 1)[1]
        for line in text.splitlines()
        if not line.lstrip().startswith("#") and "  # " in line
    }


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3"])
def test_init_writes_params_for_a_tiny_verifier_that_the_verifier_stage_runs(tmp_path: Path, capsys, arch: str):
    template = QWEN3_LIKE if arch == "qwen3" else None
    model = build_verifier_folder(tmp_path / arch, arch, template)
    out = tmp_path / "params.yaml"
    code, printed, _ = _init(capsys, str(model), "--out", str(out), "--gpus", "8", "--gpu-memory-gib", "80")
    assert code == 0, printed
    params = load_params(out)  # the strict check
    assert params.verifier.model == str(model)
    assert params.verifier.aux_layers == [1, 3, 5]  # 6 layers: [2, 3, 3] collides, so spread
    assert params.prepare.reasoning == ("keep" if arch == "qwen3" else None)
    assert params.train.draft_arch == ("qwen3" if arch == "qwen3" else "auto")
    assert params.convert.draft_vocab_size is None  # a 300-token vocabulary: the draft predicts all of it
    assert params.extract.vllm.tensor_parallel_size == 1  # a tiny model fits one GPU
    comments = _commented(out.read_text())
    assert "aux_layers" in comments and "collides" in comments["aux_layers"]
    assert ("reasoning" in comments) == (arch == "qwen3")
    assert f"wrote {out}" in printed

    info = build_verifier(params.verifier, tmp_path / "models" / "verifier")  # the params run
    assert info.aux_layers == [1, 3, 5] and info.model_type == arch


def test_init_leaves_remote_code_off_and_names_the_files_to_read(tmp_path: Path, capsys):
    plain = build_tiny_verifier(tmp_path / "plain", num_layers=8)
    remote = build_tiny_verifier(tmp_path / "remote", num_layers=8, auto_map=True)
    for folder, ships_code in ((plain, False), (remote, True)):
        out = tmp_path / f"{folder.name}.yaml"
        code, _, err = _init(capsys, str(folder), "--out", str(out))
        assert code == 0
        params = load_params(out)
        assert params.verifier.trust_remote_code is False  # a person turns it on, never init
        assert params.verifier.aux_layers == [2, 4, 5]  # EAGLE-3's [2, N//2, N-3]
        comment = _commented(out.read_text()).get("trust_remote_code", "")
        assert ('"modeling_custom.py"' in comment and "set verifier.trust_remote_code: true" in comment) is ships_code
        assert (
            "warning:" in err and '"modeling_custom.py"' in err and len(err.strip().splitlines()) == 1
        ) is ships_code


def test_init_escapes_the_model_s_strings_in_its_comments(tmp_path: Path, tiny_verifier_dir: Path, capsys):
    folder = tmp_path / "model"
    shutil.copytree(tiny_verifier_dir, folder)
    clean, hostile = tmp_path / "clean.yaml", tmp_path / "hostile.yaml"
    assert _init(capsys, str(folder), "--out", str(clean))[0] == 0
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "llama\ntrain:\n  lr: 1\x1b[2J\u2028x"
    config["auto_map"] = {"AutoModelForCausalLM": "evil\nverifier:\n  trust_remote_code: true #.Model"}
    (folder / "config.json").write_text(json.dumps(config))
    code, _, err = _init(capsys, str(folder), "--out", str(hostile))
    assert code == 0
    parsed = yaml.safe_load(hostile.read_text())
    assert parsed == yaml.safe_load(clean.read_text())  # nothing the model wrote became YAML
    assert parsed["verifier"]["trust_remote_code"] is False
    comments = _commented(hostile.read_text())
    assert comments["model"].startswith('"llama\\ntrain:\\n  lr: 1\\u001b[2J\\u2028x", 8 layers')
    assert '"evil\\nverifier:\\n  trust_remote_code: true #.py"' in comments["trust_remote_code"]
    assert len(err.strip().splitlines()) == 1 and "\x1b" not in err  # the warning is one line, too


def test_init_on_the_builtin_verifier(tmp_path: Path, capsys):
    out = tmp_path / "params.yaml"
    assert (
        _init(capsys, "builtin:smollm2-135m-instruct", "--out", str(out), "--gpus", "0", "--gpu-memory-gib", "0")[0]
        == 0
    )
    params = load_params(out)
    # On a CPU, init chooses what the committed demo params hold.
    demo = load_params(REPO / "params.yaml")
    assert params.verifier.aux_layers == [2, 15, 27]
    assert params.convert.draft_vocab_size == demo.convert.draft_vocab_size == 4096
    assert params.model_dump(exclude={"verifier"}) == demo.model_dump(exclude={"verifier"})


def test_engine_widths_follow_the_gpus():
    big = VerifierFacts(
        model="m",
        model_type="deepseek_v3",
        num_layers=61,
        num_attention_heads=128,
        vocab_size=129_280,
        weight_bytes=640 * 2**30,
        remote_code=False,
        reasoning_template=False,
    )
    assert tensor_parallel(big, Gpus(8, 141), engines=1, utilization=0.85) == 8
    assert tensor_parallel(big, Gpus(8, 80), engines=1, utilization=0.85) is None
    values, why = choose(big, Gpus(8, 141))
    # Three interleaved engines of 640 GiB do not fit on 8 x 141 GiB: evaluate times them one after another.
    assert values["evaluate.timing"] == "sequential"
    assert values["convert.draft_vocab_size"] == 32_000
    assert values["extract.batch_tokens"] == 8192  # a CPU keeps the default, a forward per row
    values, why = choose(big, Gpus(8, 80))
    assert "does not fit" in why["extract.vllm.tensor_parallel_size"]
    assert init_aux_layers(61) == [2, 30, 58] and init_aux_layers(2) == [1]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d, "not a model folder (no config.json)"),
        (lambda d: d / "missing", "no such folder"),
        (
            lambda d: (d / "config.json").write_text(json.dumps({"model_type": "x"})) and d,
            "not a decoder model's config",
        ),
    ],
)
def test_init_refuses_what_is_not_a_model_in_one_line(tmp_path: Path, capsys, make, message):
    folder = tmp_path / "folder"
    folder.mkdir()
    target = make(folder)
    code, _, err = _init(capsys, str(target), "--out", str(tmp_path / "params.yaml"))
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "params.yaml").exists()


def test_init_keeps_an_existing_file_unless_forced(tmp_path: Path, tiny_verifier_dir: Path, capsys):
    out = tmp_path / "params.yaml"
    out.write_text("mine: true\n")
    code, _, err = _init(capsys, str(tiny_verifier_dir), "--out", str(out))
    assert code == 2 and "exists; pass --force" in err and out.read_text() == "mine: true\n"
    assert _init(capsys, str(tiny_verifier_dir), "--out", str(out), "--force")[0] == 0
    assert yaml.safe_load(out.read_text())["verifier"]["model"] == str(tiny_verifier_dir)
    code, _, err = _init(capsys, str(tiny_verifier_dir), "--out", str(out), "--gpus", "2")
    assert code == 2 and "--gpus and --gpu-memory-gib go together" in err
