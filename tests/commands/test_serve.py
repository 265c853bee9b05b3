"""`eaglenest serve`: the refusals before anything starts (fast), and the real servers on the tiny SmolLM2
pipeline measured by `eaglenest bench --serve`, against evaluate's in-process figure (slow)."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from eaglenest.artifacts.prepared import VAL_PROMPTS_FILE
from eaglenest.commands import cli
from eaglenest.core.errors import EaglenestError
from tests.conftest import requires_vllm
from tests.fixtures.bench import schedule_record
from tests.fixtures.pipeline import SharedPipeline, project_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers_or_exited(server: subprocess.Popen, port: int) -> bool:
    """Whether the server on ``port`` answers ``/v1/models``, or has exited (a waiter then stops waiting)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as response:
            return response.status == 200
    except OSError:
        return server.poll() is not None


@pytest.fixture
def no_exec(monkeypatch: pytest.MonkeyPatch) -> list:
    """Records what would have been run instead of starting a server."""
    from eaglenest.commands import serve

    calls: list = []
    monkeypatch.setattr(serve, "run_in_foreground", lambda *args: calls.append(args) or 0)
    return calls


def test_a_taken_port_is_refused_before_anything_starts(capsys, no_exec, tmp_path: Path):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        status = cli.main(
            ["serve", "--port", str(port), "--verifier", str(tmp_path / "v"), "--draft", str(tmp_path / "d")]
        )
    err = capsys.readouterr().err.strip()
    assert status == 2 and no_exec == []
    assert err.count("\n") == 0 and f"--port {port}" in err and "already in use" in err and "--port" in err


def test_print_command_is_the_exact_server_command(capsys, no_exec, pipeline_folders):
    verifier, draft = pipeline_folders
    assert (
        cli.main(["serve", "--verifier", str(verifier), "--draft", str(draft), "--port", "8123", "--print-command"])
        == 0
    )
    line = capsys.readouterr().out.strip()
    argv = shlex.split(line)
    argv = argv[next(i for i, a in enumerate(argv) if "=" not in a) :]  # past the environment
    assert no_exec == []
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--port") + 1] == "8123" and argv[argv.index("--host") + 1] == "127.0.0.1"
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": str(draft.resolve()), "num_speculative_tokens": 3}
    model = Path(argv[argv.index("--model") + 1])
    assert (model / "config.json").is_file()
    assert argv[argv.index("--served-model-name") + 1] == "tiny/llama"


def test_flags_after_the_separator_go_to_vllm_and_its_own_flags_are_refused(capsys, no_exec, pipeline_folders):
    """``--`` hands the rest to vLLM as it is; a flag eaglenest sets itself is refused in one line naming the
    eaglenest flag to use, and another command given ``--`` is refused by the parser."""
    verifier, draft = pipeline_folders
    assert (
        cli.main(
            [
                "serve",
                "--verifier",
                str(verifier),
                "--draft",
                str(draft),
                "--served-model-name",
                "mine",
                "--print-command",
                "--",
                "--tensor-parallel-size",
                "2",
                "--max-model-len=4096",
            ]
        )
        == 0
    )
    argv = shlex.split(capsys.readouterr().out.strip())
    assert argv[-3:] == ["--tensor-parallel-size", "2", "--max-model-len=4096"]
    assert argv[argv.index("--served-model-name") + 1] == "mine"
    assert (
        cli.main(["serve", "--verifier", str(verifier), "--draft", str(draft), "--print-command", "--", "--port=9000"])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--port after --" in err and "eaglenest serve's own --port" in err
    with pytest.raises(SystemExit):
        cli.main(["summary", "--", "--x"])
    assert "only `eaglenest serve -- FLAGS`" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("execution", "cpu_build", "eager"),
    [("auto", True, True), ("compiled", True, False), ("auto", False, False), ("eager", False, True)],
)
def test_the_server_runs_eager_or_compiled_as_asked(pipeline_folders, monkeypatch, execution, cpu_build, eager):
    """``--execution``: auto is eager on vLLM's CPU build (as the pipeline's engines run) and compiled on GPUs;
    compiled on the CPU build turns vLLM's ahead-of-time compile cache off, which does not load there."""
    from eaglenest.commands.serve.command import ServeOptions, build_command
    from eaglenest.core.vllm_support import AOT_COMPILE_ENV, INDUCTOR_CACHE_ENV

    monkeypatch.setenv(AOT_COMPILE_ENV, "unset")  # recorded, so that what the code under test sets is undone
    monkeypatch.delenv(AOT_COMPILE_ENV)
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, "/home/me/inductor")  # the user's choice stands
    verifier, draft = pipeline_folders
    command = build_command(ServeOptions(verifier, draft, execution=execution), cpu_build=cpu_build)
    assert ("--enforce-eager" in command.argv) is eager
    assert command.env.get(AOT_COMPILE_ENV) == ("0" if cpu_build and not eager else None)
    assert command.env.get(INDUCTOR_CACHE_ENV) == (None if eager else "/home/me/inductor")
    with pytest.raises(EaglenestError, match=r"^--execution lazy: expected one of auto, eager, compiled$"):
        build_command(ServeOptions(verifier, draft, execution="lazy"), cpu_build=cpu_build)


def test_version_names_the_installed_distribution(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("eaglenest 0.")


def test_k_can_be_served_below_the_drafts_own(capsys, no_exec, pipeline_folders):
    verifier, draft = pipeline_folders
    assert (
        cli.main(
            [
                "serve",
                "--verifier",
                str(verifier),
                "--draft",
                str(draft),
                "--num-speculative-tokens",
                "2",
                "--print-command",
            ]
        )
        == 0
    )
    argv = shlex.split(capsys.readouterr().out.strip())
    assert json.loads(argv[argv.index("--speculative-config") + 1])["num_speculative_tokens"] == 2
    assert (
        cli.main(
            [
                "serve",
                "--verifier",
                str(verifier),
                "--draft",
                str(draft),
                "--num-speculative-tokens",
                "0",
                "--print-command",
            ]
        )
        == 2
    )
    assert "--num-speculative-tokens 0: must be at least 1 (the draft's own K is 3)" in capsys.readouterr().err


def test_a_baseline_server_for_bench_serves_ngram_or_no_drafting(capsys, no_exec, pipeline_folders, tmp_path: Path):
    """``--baseline``: the server ``eaglenest bench --baseline-url`` compares the draft's against, on the same
    verifier, name and flags: n-gram drafting at the setting the free_sweep stage measured (without its record,
    vLLM's default window at the draft's K), or no drafting at all."""
    verifier, draft = pipeline_folders
    assert (
        cli.main(
            [
                "serve",
                "--verifier",
                str(verifier),
                "--draft",
                str(draft),
                "--baseline",
                "ngram",
                "--free-sweep",
                str(tmp_path / "absent.json"),
                "--print-command",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    argv = shlex.split(captured.out.strip())
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 5,
        "prompt_lookup_max": 5,
    }
    assert (
        f"baseline: n-gram drafting at window 5:5, K = 3 (vLLM's default window: no {tmp_path / 'absent.json'}"
        in captured.err
    )
    assert (
        cli.main(["serve", "--verifier", str(verifier), "--draft", str(draft), "--baseline", "none", "--print-command"])
        == 0
    )
    argv = shlex.split(capsys.readouterr().out.strip())
    assert "--speculative-config" not in argv and argv[argv.index("--served-model-name") + 1] == "tiny/llama"


def test_the_hybrid_is_served_at_the_setting_evaluate_measured_for_this_draft_alone(
    capsys, no_exec, pipeline_folders, tmp_path: Path
):
    """``--hybrid``: the draft as EAGLE-3 at the hybrid's largest K, suffix decoding's settings in vLLM's own fields,
    and the drafter's settings in ``--additional-config`` (what enables the plugin for this server), from evaluate's
    record of this very draft; one measured on another draft, none measured, or a K or baseline beside it: one
    line."""
    from eaglenest.artifacts.draft_hash import draft_fingerprint
    from eaglenest.core.drafter.config import CONFIG_KEY, DrafterConfig, SuffixConfig

    verifier, draft = pipeline_folders
    config = DrafterConfig(draft_k=2, suffix=SuffixConfig(k=8, threshold=0.43, max_tree_depth=12, max_spec_factor=2.0))
    details = tmp_path / "details.json"
    record = {"measured": True, "setting": config.model_dump(), "why": "threshold 0.43: on val"}
    details.write_text(json.dumps({"runs": {"vllm": {"hybrid": record | {"draft_sha256": draft_fingerprint(draft)}}}}))
    flags = ["serve", "--verifier", str(verifier), "--draft", str(draft), "--hybrid", str(details), "--print-command"]
    assert cli.main(flags) == 0
    captured = capsys.readouterr()
    argv = shlex.split(captured.out.strip())
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "method": "eagle3",
        "model": str(draft.resolve()),
        "num_speculative_tokens": 8,
        "disable_padded_drafter_batch": True,
        "suffix_decoding_max_tree_depth": 12,
        "suffix_decoding_max_spec_factor": 2.0,
        "suffix_decoding_min_token_prob": 0.1,
        "suffix_decoding_max_cached_requests": 10000,
    }
    assert json.loads(argv[argv.index("--additional-config") + 1]) == {CONFIG_KEY: config.model_dump()}
    assert "the hybrid: the draft at K = 2, suffix decoding K = 8, depth 12 (threshold 0.43: on val" in captured.err
    refused = {
        "another draft": (record | {"draft_sha256": "f" * 64}, [], "the hybrid was measured on another draft"),
        "none measured": ({"measured": False, "why": "no val set"}, [], "evaluate measured no hybrid (no val set)"),
        "a K beside it": (
            record | {"draft_sha256": draft_fingerprint(draft)},
            ["--num-speculative-tokens", "2"],
            "--num-speculative-tokens with --hybrid",
        ),
        "a baseline": (record, ["--baseline", "suffix"], "--hybrid with --baseline suffix"),
    }
    for case, (hybrid, extra, message) in refused.items():
        details.write_text(json.dumps({"runs": {"vllm": {"hybrid": hybrid}}}))
        assert cli.main([*flags, *extra]) == 2, case
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, (case, err)


def test_serve_follows_the_serving_plan_of_this_draft_where_no_flag_chooses(
    capsys, monkeypatch, no_exec, pipeline_folders, tmp_path: Path
):
    """The plan stage's method is served where no flag chose one: a free drafter as its baseline, plain decoding as
    no drafting; a plan of another draft is passed over in one line, and --no-plan or a flag of the user's wins."""
    from eaglenest.artifacts.draft_hash import draft_fingerprint

    verifier, draft = pipeline_folders
    monkeypatch.chdir(tmp_path)
    plan = tmp_path / "metrics" / "serving_plan.json"
    plan.parent.mkdir(exist_ok=True)
    folders = ["serve", "--verifier", str(verifier), "--draft", str(draft), "--print-command"]

    def served(method: str, sha256: str, *flags: str) -> tuple[list[str], str]:
        plan.write_text(json.dumps({"draft_sha256": sha256, "method": method, "why": "suffix was fastest"}))
        assert cli.main([*folders, *flags]) == 0
        captured = capsys.readouterr()
        return shlex.split(captured.out.strip()), captured.err

    argv, err = served("suffix", draft_fingerprint(draft))
    assert json.loads(argv[argv.index("--speculative-config") + 1])["method"] == "suffix"
    assert f"serving plan ({Path('metrics/serving_plan.json')}): suffix, suffix was fastest" in err
    argv, _ = served("plain", draft_fingerprint(draft))
    assert "--speculative-config" not in argv
    for flags in (["--no-plan"], ["--num-speculative-tokens", "2"]):
        argv, err = served("suffix", draft_fingerprint(draft), *flags)
        assert (
            json.loads(argv[argv.index("--speculative-config") + 1])["method"] == "eagle3" and "serving plan" not in err
        )
    argv, err = served("suffix", "f" * 64)
    assert json.loads(argv[argv.index("--speculative-config") + 1])["method"] == "eagle3"
    assert "serving plan passed over: metrics/serving_plan.json was made for another draft" in err


def print_command(capsys, *flags: str) -> tuple[int, dict | None, str]:
    """``eaglenest serve --print-command``: its status, the speculative config it passes, and its stderr."""
    status = cli.main(["serve", "--print-command", *flags])
    captured = capsys.readouterr()
    if status != 0:
        return status, None, captured.err
    argv = shlex.split(captured.out.strip())
    return status, json.loads(argv[argv.index("--speculative-config") + 1]), captured.err


@requires_vllm
def test_a_schedule_measured_for_this_draft_is_served_up_to_max_num_seqs(
    capsys, monkeypatch, no_exec, tmp_path, pipeline_folders
):
    """The record at its default place is read; its last range ends at the server's max_num_seqs: vLLM's default
    for the build (128 per rank on CPU), or --max-num-seqs after --. stderr says which schedule and whence."""
    from eaglenest.core.vllm_schedule import default_max_num_seqs

    verifier, draft = pipeline_folders
    monkeypatch.chdir(tmp_path)  # the default record, metrics/serve_schedule.json, is this folder's
    folders = ("--verifier", str(verifier), "--draft", str(draft))
    status, spec, err = print_command(capsys, *folders)
    assert status == 0 and "num_speculative_tokens_per_batch_size" not in spec
    assert (
        "K per batch size: none, the same K at every batch size (no metrics/serve_schedule.json; "
        "`eaglenest bench --serve` measures one)" in err
    )
    schedule_record(tmp_path / "metrics" / "serve_schedule.json", draft)
    status, spec, err = print_command(capsys, *folders)
    default = default_max_num_seqs(1)
    assert status == 0 and spec["num_speculative_tokens"] == 3
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 4, 3], [5, default, 0]]
    assert (
        f"eaglenest serve: K per batch size: K 3 at 1-4, 0 at 5-{default} (measured for this draft by "
        "eaglenest bench at abc1234 on a test CPU, metrics/serve_schedule.json: x1.20 (95% 1.10-1.30) at 1" in err
    )
    status, spec, _ = print_command(capsys, *folders, "--", "--max-num-seqs", "3")
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 3, 3]]
    status, spec, _ = print_command(capsys, *folders, "--", "--max-num-seqs=16", "-tp", "2")
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 4, 3], [5, 16, 0]]
    status, spec, err = print_command(capsys, *folders, "--", "--tensor-parallel-size", "2")
    assert spec["num_speculative_tokens_per_batch_size"][-1] == [5, default_max_num_seqs(2), 0]
    status, _, err = print_command(capsys, *folders, "--", "--max-num-seqs", "many")
    assert status == 2 and "--max-num-seqs many after --: expected a whole number" in err
    # turned off; told the K it was measured at (kept) or another (dropped, with the reason)
    status, spec, err = print_command(capsys, *folders, "--no-schedule")
    assert "num_speculative_tokens_per_batch_size" not in spec and "(--no-schedule)" in err
    status, spec, _ = print_command(capsys, *folders, "--num-speculative-tokens", "3")
    assert spec["num_speculative_tokens_per_batch_size"][0] == [1, 4, 3]
    status, spec, err = print_command(capsys, *folders, "--num-speculative-tokens", "2")
    assert spec == {"method": "eagle3", "model": str(draft.resolve()), "num_speculative_tokens": 2}
    assert "was measured at K=3, and K=2 is served" in err
    # a baseline never takes one
    status, spec, err = print_command(capsys, *folders, "--baseline", "ngram")
    assert spec["method"] == "ngram" and "num_speculative_tokens_per_batch_size" not in spec
    assert "K per batch size" not in err


def test_a_schedule_of_another_draft_is_passed_over_by_default_and_refused_when_named(
    capsys, monkeypatch, no_exec, tmp_path, pipeline_folders
):
    verifier, draft = pipeline_folders
    monkeypatch.chdir(tmp_path)
    record = schedule_record(tmp_path / "metrics" / "serve_schedule.json", draft)
    (draft / "model.safetensors").write_bytes(b"retrained")
    folders = ("--verifier", str(verifier), "--draft", str(draft))
    status, spec, err = print_command(capsys, *folders)
    assert status == 0 and "num_speculative_tokens_per_batch_size" not in spec
    assert (
        "metrics/serve_schedule.json was measured on another draft; `eaglenest bench --serve` measures one "
        "for this one" in err
    )
    status, _, err = print_command(capsys, *folders, "--schedule", str(record))
    assert status == 2 and err.strip().count("\n") == 0
    assert f"--schedule {record} was measured on another draft" in err
    status, _, err = print_command(capsys, *folders, "--schedule", str(tmp_path / "typo.json"))
    assert status == 2 and "typo.json: no such file" in err
    record.write_text("{}")
    status, _, err = print_command(capsys, *folders)
    assert (
        status == 2
        and err.strip().count("\n") == 0
        and f"{Path('metrics/serve_schedule.json')}: not a serve schedule record (KeyError: 'draft')" in err
        and "--no-schedule" in err
    )
    status, _, _ = print_command(capsys, *folders, "--no-schedule")
    assert status == 0  # the way past a broken record
    with pytest.raises(SystemExit):
        cli.main(["serve", *folders, "--no-schedule", "--schedule", str(record), "--print-command"])
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("config", [None, {"speculators_model_type": "mlp_speculator"}, {"model_type": "llama"}])
def test_a_draft_that_is_not_eagle3_is_refused(capsys, no_exec, pipeline_folders, config):
    verifier, draft = pipeline_folders
    if config is None:
        (draft / "config.json").unlink()
    else:
        (draft / "config.json").write_text(json.dumps(config))
    status = cli.main(["serve", "--verifier", str(verifier), "--draft", str(draft), "--port", str(free_port())])
    err = capsys.readouterr().err.strip()
    assert status == 2 and no_exec == [] and err.count("\n") == 0
    assert f"--draft {draft}" in err and "models/draft" in err


# --- the real server (slow) ----------------------------------------------------------------------------
@pytest.mark.slow
@requires_vllm
def test_a_killed_serve_leaves_no_vllm_process(pipeline_folders, tmp_path: Path):
    """`kill -9` of `eaglenest serve` takes vLLM's API server and its engine processes with it. The tiny verifier
    with heads of 32 (a size vLLM's CPU build has kernels for), served alone (--baseline none: no draft to load)."""
    import time

    from tests.commands.test_supervised import alive, descendants, wait_for
    from tests.fixtures.models import build_tiny_verifier

    verifier, draft = pipeline_folders
    model = build_tiny_verifier(tmp_path / "model32", hidden_size=128, num_heads=4)
    record = json.loads((verifier / "verifier.json").read_text())
    (verifier / "verifier.json").write_text(
        json.dumps({**record, "source": str(model), "path": str(model), "hidden_size": 128})
    )
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "eaglenest",
            "serve",
            "--verifier",
            str(verifier),
            "--draft",
            str(draft),
            "--baseline",
            "none",
            "--dtype",
            "float32",
            "--port",
            str(port),
            "--",
            "--max-model-len",
            "256",
        ],
        cwd=tmp_path,
        env=project_env(VLLM_CPU_KVCACHE_SPACE="1"),
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "serve.log").open("wb"),
    )

    try:
        assert wait_for(lambda: answers_or_exited(server, port), timeout_s=600) and server.poll() is None, (
            tmp_path / "serve.log"
        ).read_text()[-3000:]
        tree = descendants(server.pid)
        engines = [
            pid
            for pid in tree
            if "EngineCore" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
            or "EngineCore" in Path(f"/proc/{pid}/comm").read_text()
        ]
        server.kill()
        server.wait()
        started = time.monotonic()
        assert wait_for(lambda: not any(alive(pid) for pid in tree), timeout_s=10), [
            (pid, Path(f"/proc/{pid}/cmdline").read_text(errors="replace")[:80]) for pid in tree if alive(pid)
        ]
        print(
            f"serve's tree of {len(tree)} processes ({len(engines)} engine core) gone "
            f"{time.monotonic() - started:.1f} s after kill -9"
        )
    finally:  # whatever failed, nothing of the server outlives the test
        leftovers = descendants(server.pid)
        server.kill()
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)


@pytest.mark.slow
@requires_vllm
def test_bench_against_the_served_draft_and_plain_server_agrees_with_evaluate(
    shared_pipeline: SharedPipeline, tmp_path: Path
):
    """`eaglenest bench --serve` on the real servers: the draft server (eaglenest serve), then the plain one, at
    concurrency 1 and 4 on evaluate's first set's prompts. float32, so the served draft decodes as the hf
    reference does: tau at concurrency 1 is evaluate's in-process figure on the same prompt tokens, and every
    output equals the plain server's exactly."""
    import yaml

    repo = shared_pipeline.repo
    first_set = yaml.safe_load((repo / "params.yaml").read_text())["evaluate"]["sets"][0]
    num_prompts, max_tokens = first_set["num_prompts"], first_set["max_new_tokens"]
    out = tmp_path / "bench"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "eaglenest",
            "bench",
            "--serve",
            "--port",
            str(free_port()),
            "--dtype",
            "float32",
            "--verifier",
            str(repo / "models" / "verifier"),
            "--draft",
            str(repo / "models" / "draft"),
            "--prompts",
            str(repo / "data" / "prepared" / VAL_PROMPTS_FILE),
            "--concurrency",
            "1",
            "4",
            # no warm-up run: counts and outputs are what is checked, and a cold first request changes neither
            "--num-prompts",
            str(num_prompts),
            "--max-tokens",
            str(max_tokens),
            "--warmup-prompts",
            "0",
            "--rounds",
            "1",  # tau and outputs are what is checked; rounds add intervals, not those
            "--server-timeout",
            "600",
            "--timeout",
            "600",
            "--out",
            str(out),
        ],
        cwd=tmp_path,
        env=project_env(VLLM_CPU_KVCACHE_SPACE="1"),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    bench_result = json.loads((out / "bench.json").read_text())
    assert bench_result["complete"] and (out / "speedup.png").is_file()
    reference = shared_pipeline.figures("hf", first_set["name"])
    k = reference["num_speculative_tokens"]
    for row in bench_result["results"]:
        draft, plain = row["draft"], row["baseline"]
        assert draft["completed"] == plain["completed"] == num_prompts and draft["failed"] == plain["failed"] == 0
        assert draft["counter_problems"] == [] and plain["counter_problems"] == [] and "tau" not in plain
        assert draft["drafts"] > 0 and len(draft["accepted_per_position"]) <= k
        assert 1.05 < draft["tau"] <= k + 1 and draft["tau"] == draft["tau_vllm"]
        # float32 on both servers: equal outputs, no near-tie needed
        assert row["outputs"]["identical"] == num_prompts, row["outputs"]
        assert row["speedup"] == pytest.approx(draft["tokens_per_s"] / plain["tokens_per_s"], rel=1e-2)
    single = bench_result["results"][0]["draft"]
    print("bench fp32 tau at concurrency 1", single["tau"], "in-process hf tau", reference["tau"])
    # Same prompt tokens and lengths, float32: the counts agree; 2% leaves room for a reply one side ends on a
    # stop token the other does not, without hiding a broken draft.
    assert single["tau"] == pytest.approx(reference["tau"], rel=0.02)


@pytest.mark.slow
@requires_vllm
def test_the_served_schedule_is_followed_step_by_step(shared_pipeline: SharedPipeline, tmp_path: Path):
    """vLLM's CPU build honours K per batch size step by step: the draft server given K 0 at batch size 1 and the
    draft's K from 2 on (a record made by hand) counts no draft at concurrency 1 and drafts at 4, and in float32
    every output equals the plain server's. `eaglenest bench --serve` runs it, one round, small."""
    from eaglenest.artifacts.draft import draft_tokens
    from eaglenest.artifacts.serve_schedule import write_schedule_record

    repo = shared_pipeline.repo
    draft = repo / "models" / "draft"
    k = draft_tokens(draft, "the draft")
    record = tmp_path / "serve_schedule.json"
    write_schedule_record(
        record, draft, k, [(1, 1, 0), (2, 8, k)], 8, "by hand: no speculation at batch size 1", [], {}, "test", {}
    )
    out = tmp_path / "bench"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "eaglenest",
            "bench",
            "--serve",
            "--port",
            str(free_port()),
            "--dtype",
            "float32",
            "--verifier",
            str(repo / "models" / "verifier"),
            "--draft",
            str(draft),
            "--schedule",
            str(record),
            "--num-speculative-tokens",
            str(k),
            "--prompts",
            str(repo / "data" / "prepared" / VAL_PROMPTS_FILE),
            "--concurrency",
            "1",
            "4",
            "--num-prompts",
            "8",
            "--max-tokens",
            "16",
            "--warmup-prompts",
            "0",
            "--rounds",
            "1",
            "--server-timeout",
            "600",
            "--out",
            str(out),
            "--",
            "--max-num-seqs",
            "8",
        ],
        cwd=tmp_path,
        env=project_env(VLLM_CPU_KVCACHE_SPACE="1"),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    bench_result = json.loads((out / "bench.json").read_text())
    assert bench_result["schedule"]["served"] == [[1, 1, 0], [2, 8, k]]
    assert (
        f'"num_speculative_tokens_per_batch_size": [[1, 1, 0], [2, 8, {k}]]'
        in bench_result["servers"]["draft"]["command"]
    )
    alone, four = bench_result["results"]
    # at batch size 1 the scheduler schedules no draft token, so the counters stay put (bench checks it too)
    assert alone["draft"]["drafts"] == 0 and alone["draft"]["counter_problems"] == []
    assert four["draft"]["drafts"] > 0
    for row in (alone, four):
        assert row["outputs"]["identical"] == 8 and row["draft"]["failed"] == 0, row["outputs"]
    print("per-step schedule check:", {r["concurrency"]: (r["draft"]["drafts"], r["speedup"]) for r in (alone, four)})


def test_an_api_key_after_the_separator_reaches_vllm_in_its_environment_never_in_a_command_line(
    capsys, monkeypatch, no_exec, pipeline_folders
):
    """``--api-key`` (and ``--hf-token``) after ``--``: the secret goes to vLLM as ``VLLM_API_KEY`` (``HF_TOKEN``),
    out of its argv, and the command printed, logged or recorded shows ``***``."""
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    verifier, draft = pipeline_folders
    base = ["serve", "--verifier", str(verifier), "--draft", str(draft), "--port", str(free_port())]
    assert cli.main([*base, "--", "--api-key", "s3cret-key", "--hf-token=hf_s3cret", "--max-model-len", "512"]) == 0
    err = capsys.readouterr().err
    ((argv, env),) = no_exec
    assert env["VLLM_API_KEY"] == "s3cret-key" and env["HF_TOKEN"] == "hf_s3cret"
    assert not any("s3cret" in arg for arg in argv) and argv[-2:] == ["--max-model-len", "512"]
    assert "s3cret" not in err and "VLLM_API_KEY=***" in err and "HF_TOKEN=***" in err
    assert cli.main([*base, "--print-command", "--", "--api-key=s3cret-key"]) == 0
    captured = capsys.readouterr()
    assert "s3cret" not in captured.out + captured.err and "VLLM_API_KEY=***" in captured.out
    assert cli.main([*base, "--print-command", "--", "--api-key", "one", "two"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--api-key after --: 2 keys" in err and "VLLM_API_KEY" in err


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.7", "::", "myhost"])
def test_serving_beyond_loopback_without_an_api_key_is_refused_unless_asked_for(
    capsys, monkeypatch, no_exec, pipeline_folders, host: str
):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    verifier, draft = pipeline_folders
    base = ["serve", "--verifier", str(verifier), "--draft", str(draft), "--host", host, "--print-command"]
    assert cli.main(base) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"--host {host}: vLLM would answer at" in err and "without an API key" in err
    assert "export VLLM_API_KEY=" in err and "--no-api-key" in err
    assert cli.main([*base, "--no-api-key"]) == 0
    assert "WARNING: --host" in capsys.readouterr().err
    assert cli.main([*base, "--", "--api-key", "k"]) == 0
    assert "WARNING" not in capsys.readouterr().err
    monkeypatch.setenv("VLLM_API_KEY", "k")
    assert cli.main(base) == 0
    assert "WARNING" not in capsys.readouterr().err


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_serving_on_loopback_needs_no_api_key(capsys, monkeypatch, no_exec, pipeline_folders, host: str):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    verifier, draft = pipeline_folders
    assert (
        cli.main(["serve", "--verifier", str(verifier), "--draft", str(draft), "--host", host, "--print-command"]) == 0
    )
    assert "WARNING" not in capsys.readouterr().err


@pytest.mark.slow
@requires_vllm
def test_the_served_hybrid_loads_the_drafter_in_vllms_server_and_drafts(shared_pipeline: SharedPipeline, tmp_path):
    """`eaglenest serve --hybrid` on the shared pipeline: vLLM's own OpenAI server loads eaglenest's drafter plugin
    (its entry point) with the setting evaluate measured, answers greedy completions, and its spec-decode counters
    show drafts proposed and accepted."""
    import time
    import urllib.request

    repo = shared_pipeline.repo
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "eaglenest",
                "serve",
                "--verifier",
                str(repo / "models" / "verifier"),
                "--draft",
                str(repo / "models" / "draft"),
                "--hybrid",
                str(repo / "metrics" / "eval" / "details.json"),
                "--dtype",
                "float32",
                "--port",
                str(port),
                "--",
                "--max-model-len",
                "512",
            ],
            cwd=tmp_path,
            env=project_env(VLLM_CPU_KVCACHE_SPACE="1"),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 600
        while not answers_or_exited(server, port) and time.monotonic() < deadline:
            time.sleep(2)
        assert server.poll() is None, log.read_text()[-3000:]
        # a text that repeats (suffix decoding's) and one that does not (the draft's)
        fib = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
        prompts = [fib * 3 + "def fib(n):", "Write one sentence about the sea."]
        for prompt in prompts:
            body = json.dumps(
                {
                    "model": str(repo / "models" / "verifier"),
                    "prompt": prompt,
                    "max_tokens": 24,
                    "temperature": 0,
                    "ignore_eos": True,  # every answer its 24 tokens: steps to draft for
                }
            )
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions",
                data=body.encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=120) as response:
                assert json.loads(response.read())["choices"][0]["text"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            metrics = response.read().decode()
        counters = {
            line.split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith(("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens_total"))
        }
        assert counters.get("vllm:spec_decode_num_drafts_total", 0) > 0, counters
        said = log.read_text()
        assert "eaglenest serve: the hybrid: the draft at K =" in said
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
