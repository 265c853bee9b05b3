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

from eaglenest.commands.generated import README_TARGET, Generated, render_readme, stale
from eaglenest.commands.params_file import Params, parse_params
from eaglenest.commands.reference import TARGETS
from eaglenest.core.errors import InputFileError, ParamsError
from tests.fixtures.pipeline import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"

# Shell commands in README.md and docs/ that need a GPU, several nodes, a running server or minutes of a pipeline,
# so are not run or parsed here: each says what stands in for the check. Every entry must still appear (tested).
UNCHECKED = {
    "python -m vllm.entrypoints.openai.api_server": "starts vLLM's server; `eaglenest serve --print-command` "
    "prints it and tests/commands/test_serve.py checks the line",
}
# Pages whose shell blocks are checked like the README's (the generated ones hold none).
SHELL_PAGES = ["README.md", *(f"docs/{p.name}" for p in sorted(DOCS.glob("*.md")))]
# Tracked files that may hold an issue-like number: third-party text the project snapshots as data.
ISSUE_NUMBER_EXEMPT = {
    "data/": "snapshots of installed packages' READMEs and documentation (third-party text, training data)",
}
ISSUE_NUMBER = re.compile(
    r"\bissues?\s*#?\s*\d+\b"  # the word issue, an optional hash, a number
    r"|(?<![\w&#/.-])#\d{1,5}\b(?![\w-])",  # a hash and a number (not &#39;, not a hex colour, not an anchor)
    re.IGNORECASE,
)
WORK_LOG = re.compile(r"\b(this|last|previous|next) (session|round of work)\b|\bround \d+ of (the )?work\b",
                      re.IGNORECASE)
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
    """Applies ``dvc exp run -S key=value`` to a params mapping, parsing the value as DVC does (YAML 1.2)."""
    key, _, text = assignment.partition("=")
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
            argv = argv[:argv.index("--")]
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
        return None if words[1:] == [".venv/bin/activate"] and "VENV := .venv" in (REPO / "Makefile").read_text() \
            else "not the environment make setup creates"
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
    for wanted in ("## Quickstart", "## Install", "## Train a draft for your own verifier", "## Serve the draft",
                   "## The pipeline", "## Compare experiments"):
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
                problems.append(f"{where}: a block in {language or 'no language'}; blocks are bash, yaml (params, "
                                "checked by the next test) or text")
    assert not problems, "\n".join(problems)
    assert seen == set(UNCHECKED), f"UNCHECKED lists commands no page has any more: {set(UNCHECKED) - seen}"


@pytest.mark.parametrize("command, problem", [
    ("make demoo", "no make target"),
    ("make setup VLLM=tpu", "not a VLLM choice"),
    ("eaglenest serve --prot 8000", "refuses"),
    ("dvc exp run -S train.lrr=3e-4", "unknown key"),
    ("dvc exp run -S train.lr=2", "less than or equal to 1"),
    ("dvc metrics difff main", "refuses"),
    ("sbatch scripts/cluster/slurm.sh", "not a launcher"),
])
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
    problems = stale(REPO, (target,))
    assert not problems, "\n".join(problems)


def test_a_stale_reference_names_the_command_that_regenerates_it(tmp_path: Path):
    (tmp_path / "metrics" / "eval").mkdir(parents=True)
    shutil.copy(README, tmp_path / "README.md")
    metrics = json.loads((REPO / "metrics" / "eval.json").read_text())
    first = next(name for name, value in metrics.items() if isinstance(value, dict))
    metrics[first]["vllm_tau"] = 9.8765
    (tmp_path / "metrics" / "eval.json").write_text(json.dumps(metrics))
    shutil.copy(REPO / "metrics" / "eval" / "details.json", tmp_path / "metrics" / "eval" / "details.json")
    problems = stale(tmp_path, (README_TARGET,))
    assert problems == [f"README.md is not what `{README_TARGET.command}` writes from the current sources; run "
                        f"`{README_TARGET.command}` and commit the result"]
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
    labels = set(re.findall(r">([0-9]+\.[0-9]{2})<", svg))  # the value on each bar, kept as text
    for name, figures in metrics.items():
        if isinstance(figures, dict):
            assert name in svg
            for key in ("vllm_tau", "vllm_speedup", "vllm_ngram_speedup"):
                assert f"{figures[key]:.2f}" in labels, (name, key)
    (tmp_path / "metrics" / "eval").mkdir(parents=True)
    first = next(name for name, value in metrics.items() if isinstance(value, dict))
    del metrics[first]["vllm_ngram_speedup_ci95"]
    (tmp_path / "metrics" / "eval.json").write_text(json.dumps(metrics))
    shutil.copy(REPO / "metrics" / "eval" / "details.json", tmp_path / "metrics" / "eval" / "details.json")
    with pytest.raises(InputFileError, match=r"metrics/eval.json: no vllm_ngram_speedup with "
                                             r"vllm_ngram_speedup_ci95; the figure docs/img/headline.svg needs both"):
        headline_svg(tmp_path)


def test_a_readme_without_its_markers_is_refused_in_one_line(tmp_path: Path):
    with pytest.raises(InputFileError, match="needs exactly one block between"):
        render_readme("# no markers\n", REPO, tmp_path / "README.md")


def test_every_page_says_what_it_is_for_and_links_back():
    for page in sorted(DOCS.glob("*.md")):
        opening = page.read_text().split("\n## ")[0]
        assert "(index.md)" in opening, f"docs/{page.name}: its opening paragraph must link back to index.md"


def test_site_builds_strict(tmp_path: Path):
    """mkdocs build --strict: a broken link, a missing anchor or a page left out of the nav fails."""
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}{result.stderr}"
    assert (tmp_path / "site" / "index.html").read_text().count("Quickstart") >= 1


# A path of the machine a run happened on: a reader's machine has none of them ("a fresh clone", "a scratch folder").
# /tmp/ray/ is where Ray itself keeps each node's logs: a fact of every machine, not of this one.
MACHINE_PATH = re.compile(r"(?<![\w.~/-])/(?:tmp(?!/ray/)|work)/")


def test_docs_name_no_machines_scratch_paths():
    problems = [f"{name}:{number}: {line.strip()[:100]}" for name in SHELL_PAGES
                for number, line in enumerate((REPO / name).read_text().splitlines(), 1) if MACHINE_PATH.search(line)]
    assert not problems, "absolute /tmp/ or /work/ paths in the docs; say what the folder was (a fresh clone, a " \
                         "scratch folder):\n" + "\n".join(problems)


@pytest.mark.parametrize("line, found", [("`git clone /work/main /tmp/demo5`", True), ("--scratch /tmp/bench", True),
                                         ("`--out report/`", False), ("https://example.com/tmp/x", False),
                                         ("`/tmp/ray/session_latest/logs`", False)])
def test_the_machine_path_pattern(line: str, found: bool):
    assert bool(MACHINE_PATH.search(line)) is found


def _tracked_text_files() -> list[str]:
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [name for name in names.splitlines()
            if Path(name).suffix in TEXT_SUFFIXES and (REPO / name).is_file()
            and not any(name.startswith(prefix) for prefix in ISSUE_NUMBER_EXEMPT)]


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


@pytest.mark.parametrize("line, cited", [
    (f"see issue {N} for why", True), (f"fixed in #{N}.", True), (f"(issue #{N})", True), (f"Issues {N}", True),
    ("# a comment", False), ("color: #1f77b4", False), ("[link](#mix-sweep)", False), ("&#39;", False),
    ("K = 2 (#make-demo-at-1f28d0c)", False), ("ranks #rank", False),
])
def test_the_issue_number_pattern(line: str, cited: bool):
    assert bool(ISSUE_NUMBER.search(line)) is cited
