"""The documentation: generated references fresh, the site builds with --strict, the README's commands work,
every page says what it is for and links back, and no tracked file cites an issue number."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eaglenest.commands.generated import (
    DOCS_TARGETS,
    README_TARGET,
    Generated,
    check,
    regenerate,
    render_readme,
    stale,
    write,
)
from eaglenest.commands.generated.committed import committed_view
from eaglenest.commands.generated.concurrency import SERVE_RECORD, load_serve_record, record_bench
from eaglenest.commands.generated.training import TRAINING_SVG, drawn_md5, folder_md5, locked_md5, render_training_svg
from eaglenest.commands.params_file import Params, parse_params
from eaglenest.commands.reference import TARGETS
from eaglenest.core.errors import InputFileError, ParamsError
from tests.fixtures.bench import REAL_SWEEP_FLAGS, BenchSweep
from tests.fixtures.pipeline import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"

# Shell commands in README.md and docs/ that need a GPU, several nodes, a running server or minutes of a pipeline,
# so are not run or parsed here: each says what stands in for the check. Every entry must still appear (tested).
UNCHECKED = {
    "python -m vllm.entrypoints.openai.api_server": "starts vLLM's server; `eaglenest serve --print-command` "
    "prints it and tests/commands/test_serve.py checks the line",
    "kubectl create secret generic eaglenest-ray-token": "needs a Kubernetes cluster; "
    "tests/project/test_cluster_launchers.py checks that every pod of the manifests reads this Secret",
}
# Pages whose shell blocks are checked like the README's (the generated ones hold none).
SHELL_PAGES = ["README.md", *(f"docs/{p.name}" for p in sorted(DOCS.glob("*.md")))]
# Tracked files that may hold an issue-like number: third-party text the project snapshots as data.
ISSUE_NUMBER_EXEMPT = {
    "data/": "snapshots of installed packages' READMEs and documentation (third-party text, training data)"
}
ISSUE_NUMBER = re.compile(
    r"\bissues?\s*#?\s*\d+\b"  # the word issue, an optional hash, a number
    r"|(?<![\w&#/.-])#\d{1,5}\b(?![\w-])",  # a hash and a number (not &#39;, not a hex colour, not an anchor)
    re.IGNORECASE,
)
WORK_LOG = re.compile(
    r"\b(this|last|previous|next) (session|round of work)\b|\bround \d+ of (the )?work\b", re.IGNORECASE
)
TEXT_SUFFIXES = {".md", ".py", ".txt", ".yaml", ".yml", ".toml", ".cfg", ".sh", ".json", ".jsonl", ".csv", ""}


def _fenced_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """``(line number of the opening fence, language, lines)`` of every fenced block."""
    blocks, current, language, start = [], None, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        fence = re.match(r"^\s*```\s*([\w-]*)\s*$", line)
        if fence and current is None:
            current, language, start = [], fence.group(1), number
        elif fence:
            blocks.append((start, language, current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def _shell_commands(lines: list[str], first: int) -> list[tuple[int, str]]:
    """``(line, command)`` of a shell block: continuations joined, comments dropped, ``&&`` chains split."""
    commands, pending, start = [], "", first
    for number, line in enumerate(lines, first + 1):
        if not pending:
            start = number
        pending += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        code = shlex.split(pending, comments=True) if pending.strip() else []
        pending = ""
        part: list[str] = []
        for word in [*code, "&&"]:
            if word in ("&&", ";"):
                if part:
                    commands.append((start, shlex.join(part)))
                part = []
            else:
                part.append(word)
    return commands


def _makefile_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.MULTILINE))


def _set_override(raw: dict, assignment: str) -> None:
    """Applies ``dvc exp run -S key=value`` to a params mapping, parsing the value as DVC does (YAML 1.2); a key
    params.yaml leaves out is added with Hydra's ``+key=value`` or ``++key=value``, as DVC adds it."""
    key, _, text = assignment.partition("=")
    key = key.removeprefix("++").removeprefix("+")
    value = yaml.safe_load(text)
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value)
    *sections, last = key.split(".")
    node = raw
    for section in sections:
        node = node.setdefault(section, {})
    node[last] = value


def check_command(command: str) -> str | None:
    """Why ``command`` would not work (None when it does), or raises KeyError for a command no rule covers."""
    words = shlex.split(command)
    while words and re.match(r"^[A-Z_]+=", words[0]):  # VAR=value prefixes
        words = words[1:]
    head = words[0]
    if any(prefix in command for prefix in UNCHECKED):
        return None
    if head == "make":
        unknown = [w for w in words[1:] if "=" not in w and w not in _makefile_targets()]
        bad_vllm = [w for w in words[1:] if w.startswith("VLLM=") and w[5:] not in ("auto", "gpu", "cpu", "none")]
        return f"no make target {unknown}" if unknown else (f"{bad_vllm}: not a VLLM choice" if bad_vllm else None)
    if head in ("eaglenest", ".venv/bin/eaglenest"):
        from eaglenest.commands.cli import build_parser

        argv = words[1:]
        if "--" in argv:
            argv = argv[: argv.index("--")]
        try:
            build_parser().parse_args(argv)
        except SystemExit as exit_:
            return None if exit_.code == 0 else "eaglenest's parser refuses it"
        return None
    if head == "dvc":
        from dvc.cli.parser import get_main_parser

        try:
            args = get_main_parser().parse_args(words[1:])
        except (SystemExit, Exception):  # dvc raises DvcParserError for an unknown command
            return "dvc's parser refuses it"
        raw: dict = {}
        for assignment in getattr(args, "set_param", None) or []:
            _set_override(raw, assignment)
        try:
            parse_params(raw, "dvc exp run -S")
        except ParamsError as err:
            return str(err)
        return None
    if head == "source":
        return (
            None
            if words[1:] == [".venv/bin/activate"] and "VENV := .venv" in (REPO / "Makefile").read_text()
            else "not the environment make setup creates"
        )
    if head in ("sbatch", "kubectl"):
        # a cluster launcher (tests/project/test_cluster_launchers.py checks the files): it must be one of ours
        launchers = [w for w in words[1:] if w.startswith("scripts/cluster/")]
        ours = launchers and all((REPO / w).is_file() for w in launchers)
        return None if ours else "not a launcher of scripts/cluster/"
    if head.startswith(("scripts/", "bench/")):  # a script run by its path: it must exist and be executable
        script = REPO / head
        return None if script.is_file() and os.access(script, os.X_OK) else f"{head} is not an executable file"
    if head in ("python", ".venv/bin/python") and words[1].startswith(("scripts/", "bench/")):
        # a script or benchmark: it must exist (its flags are its own; the benchmarks take minutes to run)
        return None if (REPO / words[1]).is_file() else f"{words[1]} does not exist"
    raise KeyError(command)


def test_readme_is_a_two_minute_read():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; at most 200 (move depth into docs/)"
    headings = [line for line in lines if line.startswith("## ")]
    for wanted in (
        "## Quickstart",
        "## Install",
        "## Train a draft for your own verifier",
        "## Serve the draft",
        "## The pipeline",
        "## Compare experiments",
    ):
        assert wanted in headings, f"README.md lacks the top-level heading {wanted!r}"


def test_readme_and_docs_commands_work():
    """Every shell line of README.md and docs/ is checked (make targets, eaglenest's and dvc's parsers with the
    params of every -S, scripts that exist) or listed in UNCHECKED; every other block is yaml or text."""
    problems, seen = [], set()
    for name in SHELL_PAGES:
        for start, language, lines in _fenced_blocks((REPO / name).read_text()):
            where = f"{name}:{start}"
            if language == "bash":
                for number, command in _shell_commands(lines, start):
                    seen.update(prefix for prefix in UNCHECKED if prefix in command)
                    try:
                        problem = check_command(command)
                    except KeyError:
                        problem = "no check covers this command; check it or list it in UNCHECKED with the reason"
                    if problem:
                        problems.append(f"{name}:{number}: `{command}`: {problem}")
            elif language not in ("yaml", "text"):
                problems.append(
                    f"{where}: a block in {language or 'no language'}; blocks are bash, yaml (params, "
                    "checked by the next test) or text"
                )
    assert not problems, "\n".join(problems)
    assert seen == set(UNCHECKED), f"UNCHECKED lists commands no page has any more: {set(UNCHECKED) - seen}"


@pytest.mark.parametrize(
    "command, problem",
    [
        ("make demoo", "no make target"),
        ("make setup VLLM=tpu", "not a VLLM choice"),
        ("eaglenest serve --prot 8000", "refuses"),
        ("dvc exp run -S train.lrr=3e-4", "unknown key"),
        ("dvc exp run -S train.lr=2", "less than or equal to 1"),
        ("dvc metrics difff main", "refuses"),
        ("sbatch scripts/cluster/slurm.sh", "not a launcher"),
    ],
)
def test_a_broken_readme_command_is_caught(command: str, problem: str):
    assert problem in (check_command(command) or "")
    with pytest.raises(KeyError):
        check_command("curl https://example.com")


def test_params_blocks_pass_the_strict_check():
    """Every YAML block of README.md and docs/ is a valid params file (the README's and the recipes' promise)."""
    problems = []
    for name in SHELL_PAGES:
        for start, language, lines in _fenced_blocks((REPO / name).read_text()):
            if language != "yaml":
                continue
            raw = yaml.safe_load("\n".join(lines))
            where = f"{name}:{start}"
            if not isinstance(raw, dict) or not set(raw) <= set(Params.model_fields):
                problems.append(f"{where}: a yaml block that is not params; use a text block for other YAML")
                continue
            try:
                parse_params(raw, where)
            except ParamsError as err:
                problems.append(str(err))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("target", TARGETS, ids=[t.path for t in TARGETS])
def test_generated_reference_is_fresh(target: Generated):
    """Against the run committed with the docs: after `make demo` the workspace holds this host's run instead."""
    problems, _notes = check(REPO, (target,))
    assert not problems, "\n".join(problems)


GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
RUN_TARGETS = (README_TARGET, *(t for t in DOCS_TARGETS if t.path in ("docs/defaults.md", TRAINING_SVG)))


def _committed_docs_repo(tmp_path: Path) -> Path:
    """A git repository holding the README's and docs' figures with the run they were drawn from, committed."""
    repo = committed_view(REPO, RUN_TARGETS, tmp_path / "repo")
    shutil.rmtree(repo / "dvclive", ignore_errors=True)  # DVC's output, not git's: the figure's md5 stands for it
    subprocess.run([*GIT, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*GIT, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*GIT, "commit", "-q", "-m", "t"], cwd=repo, check=True)
    return repo


def test_docs_of_the_committed_run_are_fresh_where_the_workspace_holds_another(tmp_path: Path, capsys):
    repo = _committed_docs_repo(tmp_path)
    metrics = json.loads((repo / "metrics/eval.json").read_text())
    first = next(name for name, value in metrics.items() if isinstance(value, dict))
    metrics[first]["vllm_tau"] = 9.8765  # this host's run, as `make demo` leaves it
    (repo / "metrics/eval.json").write_text(json.dumps(metrics))
    lock = (repo / "dvc.lock").read_text()
    (repo / "dvc.lock").write_text(lock.replace(locked_md5(repo), "0" * 32 + ".dir"))
    assert regenerate(repo, RUN_TARGETS, True) == 0
    said = capsys.readouterr().out
    assert said.startswith(
        "the workspace holds another run than the one committed (dvc.lock, metrics/eval.json "
        "differ from HEAD): checked the docs against the committed run"
    )
    assert "is not what" not in said
    # a doc that really is stale: neither the committed run nor the workspace's draws it
    page = (repo / "docs/defaults.md").read_text()
    (repo / "docs/defaults.md").write_text(page.replace("The committed draft reaches vllm τ", "The draft reaches τ"))
    problems, notes = check(repo, RUN_TARGETS)
    assert [p.split(" ")[0] for p in problems] == ["docs/defaults.md"] and len(notes) == 1
    assert regenerate(repo, RUN_TARGETS, True) == 1


def test_docs_drawn_from_the_workspaces_new_run_are_fresh_before_it_is_committed(tmp_path: Path, capsys):
    repo = _committed_docs_repo(tmp_path)
    metrics = json.loads((repo / "metrics/eval.json").read_text())
    first = next(name for name, value in metrics.items() if isinstance(value, dict))
    metrics[first]["vllm_tau"] = 9.8765
    (repo / "metrics/eval.json").write_text(json.dumps(metrics))
    readme = (README_TARGET,)
    assert regenerate(repo, readme, False) == 0
    assert capsys.readouterr().out.splitlines() == [
        "wrote README.md",
        "drawn from the workspace's run, not the committed one (metrics/eval.json differ from "
        "HEAD): commit them with the docs",
    ]
    assert "9.877" in (repo / "README.md").read_text()
    assert check(repo, readme)[0] == []


def test_a_stale_reference_names_the_command_that_regenerates_it(tmp_path: Path):
    (tmp_path / "metrics" / "eval").mkdir(parents=True)
    shutil.copy(README, tmp_path / "README.md")
    metrics = json.loads((REPO / "metrics" / "eval.json").read_text())
    first = next(name for name, value in metrics.items() if isinstance(value, dict))
    metrics[first]["vllm_tau"] = 9.8765
    (tmp_path / "metrics" / "eval.json").write_text(json.dumps(metrics))
    shutil.copy(REPO / "metrics" / "eval" / "details.json", tmp_path / "metrics" / "eval" / "details.json")
    problems = stale(tmp_path, (README_TARGET,))
    assert problems == [
        f"README.md is not what `{README_TARGET.command}` writes from the current sources; run "
        f"`{README_TARGET.command}` and commit the result"
    ]
    assert "9.877" in render_readme(README.read_text(), tmp_path, tmp_path / "README.md")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "params.md").write_text("# old\n")
    assert "python scripts/gen_reference.py" in stale(tmp_path, (TARGETS[0],))[0]


def test_the_headline_figure_shows_the_metrics_at_page_width_and_names_a_missing_key(tmp_path: Path):
    from eaglenest.commands.generated import HEADLINE_SVG, headline_svg

    svg = headline_svg(REPO)
    assert svg == headline_svg(REPO)  # the same metrics, the same bytes: --check can compare it
    assert f"]({HEADLINE_SVG})" in README.read_text()
    width_pt = float(re.search(r'<svg [^>]*width="([0-9.]+)pt"', svg).group(1))
    assert width_pt * 96 / 72 <= 1600  # px at the browser's 96 per inch
    metrics = json.loads((REPO / "metrics" / "eval.json").read_text())
    details = json.loads((REPO / "metrics" / "eval" / "details.json").read_text())
    labels = set(re.findall(r">([0-9]+\.[0-9]{2})<", svg))  # the value on each bar, kept as text
    for name, figures in metrics.items():
        if isinstance(figures, dict):
            assert name in svg
            for key in ("vllm_tau", "vllm_speedup"):
                assert f"{figures[key]:.2f}" in labels, (name, key)
            entry = details["runs"]["vllm"]["sets"][name]
            free = entry["free_drafter"]  # the fastest free drafter's bar beside the draft's
            assert f"{entry['summary'][f'{free}_speedup']['value']:.2f}" in labels, (name, f"{free}_speedup")
    (tmp_path / "metrics" / "eval").mkdir(parents=True)
    first = next(name for name, value in metrics.items() if isinstance(value, dict))
    del metrics[first]["vllm_speedup_ci95"]
    (tmp_path / "metrics" / "eval.json").write_text(json.dumps(metrics))
    shutil.copy(REPO / "metrics" / "eval" / "details.json", tmp_path / "metrics" / "eval" / "details.json")
    with pytest.raises(
        InputFileError,
        match=r"metrics/eval.json: no vllm_speedup with "
        r"vllm_speedup_ci95; the figure docs/img/headline.svg needs both",
    ):
        headline_svg(tmp_path)
    free = details["runs"]["vllm"]["sets"][first]["free_drafter"]
    del details["runs"]["vllm"]["sets"][first]["summary"][f"{free}_speedup"]["ci95"]
    (tmp_path / "metrics" / "eval.json").write_text((REPO / "metrics" / "eval.json").read_text())
    (tmp_path / "metrics" / "eval" / "details.json").write_text(json.dumps(details))
    with pytest.raises(
        InputFileError, match=rf"metrics/eval/details.json \({first}\): no {free}_speedup with {free}_speedup_ci95"
    ):
        headline_svg(tmp_path)


def bench_result(speedups: dict[int, float], plain_tokens_per_s: float = 20.0) -> dict:
    """A bench.json as ``eaglenest bench --serve`` writes it (the keys the docs' figures read), with ``recorded``."""
    results = [
        {
            "concurrency": c,
            "speedup": speedup,
            "draft": {
                "completed": 8,
                "failed": 0,
                "tokens_per_s": round(plain_tokens_per_s * c * speedup, 3),
                "latency_ms": {"mean": 900.0, "p50": 880.0 * c, "p99": 990.0},
                "tau": 1.5626,
            },
            "baseline": {
                "completed": 8,
                "failed": 0,
                "tokens_per_s": plain_tokens_per_s * c,
                "latency_ms": {"mean": 950.0, "p50": 940.0 * c, "p99": 999.0},
            },
            "outputs": {"compared": 8, "identical": 7, "near_ties": [{"request": 3}], "differ": []},
        }
        for c, speedup in speedups.items()
    ]
    below = [c for c, speedup in speedups.items() if speedup < 1]
    return {
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "prompts": {"count": 8, "requests": 8},
        "max_tokens": 64,
        "temperature": 0.0,
        "concurrency": list(speedups),
        "results": results,
        "complete": True,
        "stops_paying_at": min(below) if below else None,
        "servers": {"baseline": {"kind": "none"}},
        "recorded": {
            "command": "eaglenest bench --serve --concurrency 1 4 16",
            "commit": "0123456789",
            "host": {"key": "AMD EPYC | AVX512 | bf16", "label": "AMD EPYC, AVX512 with AVX512-BF16"},
        },
    }


def _docs_copy(tmp_path: Path) -> Path:
    """The pages and measurements the docs' figures are drawn from, copied into ``tmp_path``."""
    for name in ("README.md", "docs/serving.md", "docs/defaults.md", "metrics/eval.json", "metrics/eval/details.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, tmp_path / name)
    return tmp_path


CONCURRENCY_TARGETS = tuple(
    t for t in DOCS_TARGETS if t.path in ("README.md", "docs/serving.md", "docs/img/concurrency.svg")
)


def test_the_docs_concurrency_figures_follow_the_committed_bench_result(tmp_path: Path):
    repo = _docs_copy(tmp_path)
    (repo / SERVE_RECORD).parent.mkdir(parents=True)
    (repo / SERVE_RECORD).write_text(json.dumps(bench_result({1: 1.06, 4: 0.705, 16: 0.537})))
    assert write(repo, CONCURRENCY_TARGETS) == [f"wrote {t.path}" for t in CONCURRENCY_TARGETS]
    serving = (repo / "docs/serving.md").read_text()
    for row in (
        "| 1 | 21.2 | 20.0 | x1.060 | 1.5626 | 880 / 940 | 7 / 1 / 0 |",
        "| 4 | 56.4 | 80.0 | x0.705 | 1.5626 | 3,520 / 3,760 | 7 / 1 / 0 |",
        "| 16 | 171.8 | 320.0 | x0.537 | 1.5626 | 14,080 / 15,040 | 7 / 1 / 0 |",
    ):
        assert row in serving
    assert "speculation stops paying at concurrency 4" in serving and "at 0123456789, on AMD EPYC" in serving
    readme = (repo / "README.md").read_text()
    assert "x1.06 single-stream, x0.70 at 4 requests in flight, x0.54 at 16 requests in flight" in readme
    assert "Served by `eaglenest serve` and measured" in readme  # one K throughout: no schedule named
    scheduled = bench_result({1: 1.06, 4: 0.705, 16: 0.537}) | {"schedule": {"served": [[1, 1, 2], [2, 128, 0]]}}
    (repo / SERVE_RECORD).write_text(json.dumps(scheduled))
    write(repo, CONCURRENCY_TARGETS)
    assert (
        "Served by `eaglenest serve` with its K per batch size (K 2 at 1, 0 at 2-128) and measured"
        in (repo / "README.md").read_text()
    )
    (repo / SERVE_RECORD).write_text(json.dumps(bench_result({1: 1.06, 4: 0.705, 16: 0.537})))
    write(repo, CONCURRENCY_TARGETS)
    svg = (repo / "docs/img/concurrency.svg").read_text()
    assert float(re.search(r'<svg [^>]*width="([0-9.]+)pt"', svg).group(1)) * 96 / 72 <= 1600
    assert {"1.06", "0.70", "0.54", "21.20", "320.00"} <= set(re.findall(r">([0-9]+\.[0-9]{2})<", svg))
    assert stale(repo, CONCURRENCY_TARGETS) == []
    # a page that disagrees with the file: a hand edit, then a new measurement
    (repo / "docs/serving.md").write_text(serving.replace("x0.705", "x0.750"))
    assert [p.split(" ")[0] for p in stale(repo, CONCURRENCY_TARGETS)] == ["docs/serving.md"]
    (repo / SERVE_RECORD).write_text(json.dumps(bench_result({1: 1.06, 4: 0.92, 16: 0.537})))
    assert [p.split(" ")[0] for p in stale(repo, CONCURRENCY_TARGETS)] == [t.path for t in CONCURRENCY_TARGETS]
    (repo / SERVE_RECORD).unlink()  # no measurement: the blocks say how to make one, the figure must go
    assert stale(repo, CONCURRENCY_TARGETS)[-1] == (
        "docs/img/concurrency.svg draws a measurement that is not committed; run `eaglenest report --docs` (it "
        "removes the file) and commit the result"
    )
    write(repo, CONCURRENCY_TARGETS)
    assert not (repo / "docs/img/concurrency.svg").exists()
    assert "Not measured at this commit" in (repo / "docs/serving.md").read_text()


def test_a_bench_of_several_rounds_shows_each_speedups_interval(tmp_path: Path):
    repo = _docs_copy(tmp_path)
    document = bench_result({1: 1.06, 4: 0.705})
    document["rounds"] = 3
    document["results"][0]["speedup_interval"] = {"value": 1.06, "low": 1.021, "high": 1.1, "ci95": 0.04, "units": 3}
    document["results"][1]["speedup_interval"] = None
    (repo / SERVE_RECORD).parent.mkdir(parents=True)
    (repo / SERVE_RECORD).write_text(json.dumps(document))
    write(repo, CONCURRENCY_TARGETS)
    serving = (repo / "docs/serving.md").read_text()
    assert "| 1 | 21.2 | 20.0 | x1.060 (1.021–1.100) | 1.5626 |" in serving
    assert "| 4 | 56.4 | 80.0 | x0.705 |" in serving
    assert "3 paired rounds: each speed-up is their geometric mean, with its 95% interval" in serving
    assert "8 requests per concurrency, 3 rounds, on AMD EPYC" in (repo / "README.md").read_text()
    document["results"][0]["speedup_interval"] = {"low": "x"}
    (repo / SERVE_RECORD).write_text(json.dumps(document))
    with pytest.raises(
        InputFileError,
        match=r"no results\[0\]\.speedup_interval\.low \(expected an integer or a "
        r"number\)",
    ):
        load_serve_record(repo)


@pytest.mark.slow
def test_a_real_bench_result_recorded_renders_the_docs_figures(tmp_path: Path, real_bench_sweep: BenchSweep):
    """``eaglenest bench`` (vLLM's own `vllm bench serve`) against two fake servers, recorded by the script, drawn."""
    out = real_bench_sweep.out
    assert real_bench_sweep.status == 0, real_bench_sweep.stderr
    repo = _docs_copy(tmp_path / "repo")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "t"],
        cwd=repo,
        check=True,
    )
    record = record_bench(
        out / "bench.json", shlex.join(["eaglenest", "bench", *REAL_SWEEP_FLAGS]), repo, repo / SERVE_RECORD
    )
    measured = json.loads((out / "bench.json").read_text())["results"]
    assert [(level.concurrency, level.speedup) for level in record.levels] == [
        (row["concurrency"], row["speedup"]) for row in measured
    ]
    write(repo, CONCURRENCY_TARGETS)
    serving = (repo / "docs/serving.md").read_text()
    for row in measured:
        assert (
            f"| {row['concurrency']} | {row['draft']['tokens_per_s']:.1f} | "
            f"{row['baseline']['tokens_per_s']:.1f} | x{row['speedup']:.3f} |" in serving
        )
    assert stale(repo, CONCURRENCY_TARGETS) == [] and (repo / "docs/img/concurrency.svg").is_file()


def test_recording_a_bench_result_adds_the_command_commit_and_host_kind(tmp_path: Path):
    from eaglenest.core.host import host_kind

    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "t"], cwd=repo, check=True)
    head = subprocess.run(
        ["git", "rev-parse", "--short=10", "HEAD"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.strip()
    result = bench_result({1: 1.1, 4: 0.8})
    del result["recorded"]
    (tmp_path / "bench.json").write_text(json.dumps(result))
    record = record_bench(tmp_path / "bench.json", "eaglenest bench --serve", repo, repo / SERVE_RECORD)
    assert [(level.concurrency, level.speedup) for level in record.levels] == [(1, 1.1), (4, 0.8)]
    recorded = json.loads((repo / SERVE_RECORD).read_text())["recorded"]
    assert recorded["command"] == "eaglenest bench --serve" and recorded["commit"] == head
    assert recorded["host"]["key"] == host_kind().key and recorded["host"]["label"] == host_kind().label
    script = [sys.executable, str(REPO / "scripts" / "record_serve_bench.py")]
    missing = subprocess.run(
        [*script, str(tmp_path / "none.json"), "--command", "x", "--repo", str(repo)], capture_output=True, text=True
    )
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
    assert missing.stderr.startswith(f"record_serve_bench.py: error: {tmp_path / 'none.json'}: not a bench result")


@pytest.mark.parametrize(
    "path, edit, line",
    [
        (
            "results.1.baseline",
            lambda row: row.pop("tokens_per_s"),
            "no results[1].baseline.tokens_per_s (expected an integer or a number)",
        ),
        (
            "results.0",
            lambda row: row.update(speedup="fast"),
            "no results[0].speedup (expected an integer or a number)",
        ),
        ("recorded", lambda row: row.pop("commit"), "no recorded.commit (expected text)"),
    ],
)
def test_a_bench_record_missing_a_key_is_one_line_naming_file_and_key(tmp_path: Path, path: str, edit, line: str):
    document = bench_result({1: 1.06, 4: 0.705})
    node = document
    for key in path.split("."):
        node = node[int(key)] if key.isdigit() else node[key]
    edit(node)
    (tmp_path / SERVE_RECORD).parent.mkdir(parents=True)
    (tmp_path / SERVE_RECORD).write_text(json.dumps(document))
    with pytest.raises(InputFileError) as raised:
        load_serve_record(tmp_path)
    assert str(raised.value) == (
        f"{tmp_path / SERVE_RECORD}: {line}; the figures of docs/serving.md and docs/img/concurrency.svg need it"
    )


def test_the_training_figure_was_drawn_from_the_curves_dvc_lock_records(tmp_path: Path):
    """Holds in a clone without DVC's cache: the figure carries the md5 of the curves it was drawn from, the one the
    committed dvc.lock records (after `make demo` the workspace's records this host's run)."""
    committed = committed_view(REPO, (), tmp_path / "committed")
    assert drawn_md5((REPO / TRAINING_SVG).read_text()) == locked_md5(committed)
    assert f"]({TRAINING_SVG.removeprefix('docs/')})" in (DOCS / "training.md").read_text()
    (tmp_path / "docs/img").mkdir(parents=True)
    shutil.copy(REPO / TRAINING_SVG, tmp_path / TRAINING_SVG)
    old = (tmp_path / TRAINING_SVG).read_text()
    lock = (committed / "dvc.lock").read_text()
    (tmp_path / "dvc.lock").write_text(lock)
    assert render_training_svg(old, tmp_path) == old  # no curves here, and the figure is of the locked ones
    retrained = "0" * 32 + ".dir"
    (tmp_path / "dvc.lock").write_text(lock.replace(locked_md5(committed), retrained))
    with pytest.raises(
        InputFileError,
        match=rf"{TRAINING_SVG} was drawn from dvclive/train md5 "
        rf"{locked_md5(committed)}, but dvc.lock records {retrained}, and "
        r"dvclive/train is not in the workspace: `dvc pull dvclive/train`",
    ):
        render_training_svg(old, tmp_path)
    (tmp_path / "dvclive/train").mkdir(parents=True)
    (tmp_path / "dvclive/train/metrics.json").write_text("{}")
    with pytest.raises(
        InputFileError,
        match=rf"dvclive/train: md5 [0-9a-f]{{32}}\.dir, but dvc.lock records "
        rf"{retrained}; `dvc checkout dvclive/train`",
    ):
        render_training_svg(old, tmp_path)


def test_the_committed_curves_come_from_the_dvc_cache_where_the_workspace_holds_another_run(tmp_path: Path):
    from dvc.repo import Repo

    repo = tmp_path / "repo"
    curves = repo / "dvclive/train"
    (curves / "plots/metrics/val").mkdir(parents=True)
    (curves / "plots/metrics/val/acc_0.tsv").write_text("step\tacc_0\n0\t0.1\n100\t0.3\n")
    Repo.init(str(repo), no_scm=True).add(str(curves))  # the committed curves, in DVC's cache
    md5 = yaml.safe_load((repo / "dvclive/train.dvc").read_text())["outs"][0]["md5"]
    (repo / "dvc.lock").write_text(
        yaml.safe_dump({"schema": "2.0", "stages": {"train": {"outs": [{"path": "dvclive/train", "md5": md5}]}}})
    )
    subprocess.run([*GIT, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*GIT, "add", "dvc.lock"], cwd=repo, check=True)
    subprocess.run([*GIT, "commit", "-q", "-m", "t"], cwd=repo, check=True)
    (curves / "plots/metrics/val/acc_0.tsv").unlink()  # this host's run, as dvc repro leaves it
    (curves / "plots/metrics/val/acc_0.tsv").write_text("step\tacc_0\n0\t0.2\n")
    view = committed_view(repo, (), tmp_path / "view")
    assert (view / "dvclive/train/plots/metrics/val/acc_0.tsv").read_text() == "step\tacc_0\n0\t0.1\n100\t0.3\n"
    assert folder_md5(view / "dvclive/train") == md5
    shutil.rmtree(repo / ".dvc/cache")  # neither here nor cached: left out, and the figure's md5 stands for them
    assert not (committed_view(repo, (), tmp_path / "bare") / "dvclive").exists()


def test_the_folder_md5_is_the_one_dvc_records(tmp_path: Path):
    folder = tmp_path / "curves"
    (folder / "plots" / "val").mkdir(parents=True)
    (folder / "metrics.json").write_text('{"step": 3}\n')
    (folder / "plots" / "val" / "acc_0.tsv").write_text("step\tacc_0\n0\t0.1\n100\t0.3\n")
    from dvc.repo import Repo

    Repo.init(str(tmp_path), no_scm=True).add(str(folder))  # DVC's own hashing, in this process
    recorded = yaml.safe_load((tmp_path / "curves.dvc").read_text())["outs"][0]["md5"]
    assert folder_md5(folder) == recorded


def test_every_docs_figure_is_shown_and_fits_the_page_width():
    pages = "".join(page.read_text() for page in (README, *DOCS.glob("*.md")))
    for svg in sorted((DOCS / "img").glob("*.svg")):
        width_pt = float(re.search(r'<svg [^>]*width="([0-9.]+)pt"', svg.read_text()).group(1))
        assert width_pt * 96 / 72 <= 1600, svg.name
        assert f"img/{svg.name})" in pages, f"docs/img/{svg.name} is shown on no page"


def test_a_readme_without_its_markers_is_refused_in_one_line(tmp_path: Path):
    with pytest.raises(InputFileError, match="needs exactly one block between"):
        render_readme("# no markers\n", REPO, tmp_path / "README.md")


def test_every_page_says_what_it_is_for_and_links_back():
    for page in sorted(DOCS.glob("*.md")):
        opening = page.read_text().split("\n## ")[0]
        assert "(index.md)" in opening, f"docs/{page.name}: its opening paragraph must link back to index.md"


def test_site_builds_strict(tmp_path: Path):
    """mkdocs build --strict: a broken link, a missing anchor or a page left out of the nav fails."""
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}{result.stderr}"
    assert (tmp_path / "site" / "index.html").read_text().count("Quickstart") >= 1


# A path of the machine a run happened on: a reader's machine has none of them ("a fresh clone", "a scratch folder").
# /tmp/ray/ is where Ray itself keeps each node's logs: a fact of every machine, not of this one.
MACHINE_PATH = re.compile(r"(?<![\w.~/-])/(?:tmp(?!/ray/)|work)/")


def test_docs_name_no_machines_scratch_paths():
    problems = [
        f"{name}:{number}: {line.strip()[:100]}"
        for name in SHELL_PAGES
        for number, line in enumerate((REPO / name).read_text().splitlines(), 1)
        if MACHINE_PATH.search(line)
    ]
    assert not problems, (
        "absolute /tmp/ or /work/ paths in the docs; say what the folder was (a fresh clone, a "
        "scratch folder):\n" + "\n".join(problems)
    )


@pytest.mark.parametrize(
    "line, found",
    [
        ("`git clone /work/main /tmp/demo5`", True),
        ("--scratch /tmp/bench", True),
        ("`--out report/`", False),
        ("https://example.com/tmp/x", False),
        ("`/tmp/ray/session_latest/logs`", False),
    ],
)
def test_the_machine_path_pattern(line: str, found: bool):
    assert bool(MACHINE_PATH.search(line)) is found


def _tracked_text_files() -> list[str]:
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [
        name
        for name in names.splitlines()
        if Path(name).suffix in TEXT_SUFFIXES
        and (REPO / name).is_file()
        and not any(name.startswith(prefix) for prefix in ISSUE_NUMBER_EXEMPT)
    ]


def test_no_tracked_file_cites_an_issue_number_or_a_work_session():
    problems = []
    for name in _tracked_text_files():
        try:
            text = (REPO / name).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for pattern in (ISSUE_NUMBER, WORK_LOG):
                found = pattern.search(line)
                if found:
                    problems.append(f"{name}:{number}: {found.group(0)!r}")
    assert not problems, "the project speaks of itself, not of its issues or work sessions:\n" + "\n".join(problems)


N = 27  # the examples are built, so this file cites no issue itself


@pytest.mark.parametrize(
    "line, cited",
    [
        (f"see issue {N} for why", True),
        (f"fixed in #{N}.", True),
        (f"(issue #{N})", True),
        (f"Issues {N}", True),
        ("# a comment", False),
        ("color: #1f77b4", False),
        ("[link](#mix-sweep)", False),
        ("&#39;", False),
        ("K = 2 (#make-demo-at-1f28d0c)", False),
        ("ranks #rank", False),
    ],
)
def test_the_issue_number_pattern(line: str, cited: bool):
    assert bool(ISSUE_NUMBER.search(line)) is cited


TEST_NODE = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def missing_tests(page: str) -> list[str]:
    """The test node ids ``page`` names (``tests/x.py::test_y`` in backticks) that no test file defines."""
    missing = []
    for path, name in TEST_NODE.findall(page):
        source = REPO / path
        if not source.is_file() or not re.search(rf"^(async )?def {name}\(", source.read_text(), re.MULTILINE):
            missing.append(f"{path}::{name}")
    return missing


def test_every_fault_the_reliability_table_lists_names_a_test_that_exists():
    page = (DOCS / "reliability.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| ") and not line.startswith("| fault")]
    assert rows and all(TEST_NODE.search(row) for row in rows), "a fault row without its test"
    assert missing_tests(page) == []
    assert missing_tests("`tests/project/test_docs.py::test_gone`") == ["tests/project/test_docs.py::test_gone"]
