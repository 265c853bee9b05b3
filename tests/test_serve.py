"""`eaglenest serve`: the refusals before anything starts (fast), and the real server on the tiny SmolLM2
pipeline, its spec-decode counters against the in-process figure (slow)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from eaglenest.artifacts.prepared import VAL_PROMPTS_FILE
from eaglenest.commands import cli
from eaglenest.commands.bench import ACCEPTED, DRAFT_TOKENS, DRAFTS, parse_metrics

from .conftest import requires_vllm
from .helpers import hf_reference, project_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def no_exec(monkeypatch: pytest.MonkeyPatch) -> list:
    """Records what would have been exec'd instead of starting a server."""
    calls: list = []
    monkeypatch.setattr(os, "execve", lambda *args: calls.append(args))
    return calls


def test_a_taken_port_is_refused_before_anything_starts(capsys, no_exec, tmp_path: Path):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        status = cli.main(["serve", "--port", str(port), "--verifier", str(tmp_path / "v"),
                           "--draft", str(tmp_path / "d")])
    err = capsys.readouterr().err.strip()
    assert status == 2 and no_exec == []
    assert err.count("\n") == 0 and f"--port {port}" in err and "already in use" in err and "--port" in err


def test_print_command_is_the_exact_server_command(capsys, no_exec, pipeline_folders):
    verifier, draft = pipeline_folders
    assert cli.main(["serve", "--verifier", str(verifier), "--draft", str(draft), "--port", "8123",
                     "--print-command"]) == 0
    line = capsys.readouterr().out.strip()
    argv = shlex.split(line)
    argv = argv[next(i for i, a in enumerate(argv) if "=" not in a):]  # past the environment
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
    assert cli.main(["serve", "--verifier", str(verifier), "--draft", str(draft), "--served-model-name", "mine",
                     "--print-command", "--", "--tensor-parallel-size", "2", "--max-model-len=4096"]) == 0
    argv = shlex.split(capsys.readouterr().out.strip())
    assert argv[-3:] == ["--tensor-parallel-size", "2", "--max-model-len=4096"]
    assert argv[argv.index("--served-model-name") + 1] == "mine"
    assert cli.main(["serve", "--verifier", str(verifier), "--draft", str(draft), "--print-command", "--",
                     "--port=9000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--port after --" in err and "eaglenest serve's own --port" in err
    with pytest.raises(SystemExit):
        cli.main(["summary", "--", "--x"])
    assert "only `eaglenest serve -- FLAGS`" in capsys.readouterr().err


def test_version_names_the_installed_distribution(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("eaglenest 0.")


def test_k_can_be_served_below_the_drafts_own(capsys, no_exec, pipeline_folders):
    verifier, draft = pipeline_folders
    assert cli.main(["serve", "--verifier", str(verifier), "--draft", str(draft), "--num-speculative-tokens", "2",
                     "--print-command"]) == 0
    argv = shlex.split(capsys.readouterr().out.strip())
    assert json.loads(argv[argv.index("--speculative-config") + 1])["num_speculative_tokens"] == 2
    assert cli.main(["serve", "--verifier", str(verifier), "--draft", str(draft), "--num-speculative-tokens", "0",
                     "--print-command"]) == 2
    assert "--num-speculative-tokens 0: must be at least 1 (the draft's own K is 3)" in capsys.readouterr().err


def test_a_baseline_server_for_bench_serves_ngram_or_no_drafting(capsys, no_exec, pipeline_folders):
    """``--baseline``: the server ``eaglenest bench --baseline-url`` compares the draft's against, on the same
    verifier, name and flags: n-gram drafting at the draft's K (vLLM's default window), or no drafting at all."""
    verifier, draft = pipeline_folders
    assert cli.main(["serve", "--verifier", str(verifier), "--draft", str(draft), "--baseline", "ngram",
                     "--print-command"]) == 0
    captured = capsys.readouterr()
    argv = shlex.split(captured.out.strip())
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 5}
    assert "n-gram drafting (baseline), K = 3" in captured.err
    assert cli.main(["serve", "--verifier", str(verifier), "--draft", str(draft), "--baseline", "none",
                     "--print-command"]) == 0
    argv = shlex.split(capsys.readouterr().out.strip())
    assert "--speculative-config" not in argv and argv[argv.index("--served-model-name") + 1] == "tiny/llama"


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
def _chat_prompts(repo: Path, n: int) -> list[list[dict]]:
    """The first ``n`` evaluation prompts as chat messages, as evaluate reads them."""
    messages = []
    for line in (repo / "data" / "prepared" / VAL_PROMPTS_FILE).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            messages.append(record["messages"] if "messages" in record else
                            [{"role": "user", "content": record["prompt"]}])
        if len(messages) == n:
            break
    return messages


def scrape_spec_counters(text: str) -> dict:
    """vllm:spec_decode_* counters from Prometheus text, with ``eaglenest bench``'s parser (summed over engines)."""
    counters = parse_metrics(text, "/metrics")
    return {"drafts": int(counters.totals[DRAFTS]), "draft_tokens": int(counters.totals[DRAFT_TOKENS]),
            "accepted": int(counters.totals[ACCEPTED]),
            "per_position": {p: int(v) for p, v in counters.accepted_per_pos.items()}}


def _wait_healthy(url: str, process: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    pytest.fail(f"server not healthy after {timeout} s:\n{log.read_text()[-3000:]}")


@pytest.mark.slow
@requires_vllm
def test_served_draft_accepts_as_in_process(smollm2_repo: Path, tmp_path: Path,
                                            tmp_path_factory: pytest.TempPathFactory):
    import yaml
    from openai import OpenAI

    first_set = yaml.safe_load((smollm2_repo / "params.yaml").read_text())["evaluate"]["sets"][0]
    num_prompts, max_tokens = first_set["num_prompts"], first_set["max_new_tokens"]
    port = free_port()
    log = tmp_path / "server.log"
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as log_file:
        # float32: the server then decodes exactly as the hf reference does (bf16 flips near-ties).
        process = subprocess.Popen(
            [sys.executable, "-m", "eaglenest", "serve", "--verifier", str(smollm2_repo / "models" / "verifier"),
             "--draft", str(smollm2_repo / "models" / "draft"), "--port", str(port), "--dtype", "float32"],
            cwd=tmp_path, env=project_env(), stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_healthy(url, process, log, timeout=300)
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        model = client.models.list().data[0].id
        replies = [client.chat.completions.create(model=model, messages=messages, temperature=0,
                                                  max_tokens=max_tokens)
                   for messages in _chat_prompts(smollm2_repo, num_prompts)]
        assert all(r.choices[0].message.content for r in replies)
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            counters = scrape_spec_counters(response.read().decode())
    finally:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        except ProcessLookupError:
            pass
    reference = hf_reference(str(smollm2_repo), str(tmp_path_factory.mktemp("hf-reference")))
    k = reference["num_speculative_tokens"]
    assert counters["drafts"] > 0
    assert sum(counters["per_position"].values()) == counters["accepted"]
    assert set(counters["per_position"]) <= set(range(k))
    tau = 1 + counters["accepted"] / counters["drafts"]
    print("serve fp32 tau", round(tau, 4), counters, "in-process hf tau", reference["tau"])
    assert 1.05 < tau <= k + 1
    # Same prompts, same tokens, float32: the counts should agree exactly; 2% leaves room for a reply the
    # server ends on a different stop rule (a chat endpoint's stop tokens) without hiding a broken draft.
    assert tau == pytest.approx(reference["tau"], rel=0.02)
