"""scripts/walkthrough.sh types the README's steps: it parses, every command it runs as a step is one the README
shows (or one of its own checks), and every command of the README's Quickstart, Serve and Compare experiments
sections is one of its steps. It runs the demo, so it is run by hand, never here (docs/development.md)."""

from __future__ import annotations

import re
import subprocess

from tests.fixtures.pipeline import REPO
from tests.project.test_docs import _fenced_blocks, _shell_commands

SCRIPT = REPO / "scripts" / "walkthrough.sh"
# Steps that are not the README's commands: checks of the walkthrough's own, and the form it types where a reused
# checkout's environment lives outside it.
OWN_CHECKS = {"git clone SOURCE CLONE", "dvc status", "eaglenest doctor"}
# The README sections whose every command the walkthrough runs ("Train a draft for your own verifier" needs the
# user's model and data; Scale up and Development are not a user's first hour).
WALKED_SECTIONS = ("## Quickstart", "## Install", "## Serve the draft", "## Compare experiments")
# Commands of those sections it leaves out, and why.
NOT_WALKED = {
    "make test": "the test suite, not a user's step; make test runs it",
    "make setup VLLM=gpu": "make demo sets up; forcing a build is for machines where auto picks wrongly",
    "eaglenest serve --print-command": "prints what serve runs; the walkthrough runs it",
    "eaglenest serve -- --tensor-parallel-size 8": "needs 8 GPUs",
    "eaglenest k-sweep --ks 1 2 3": "minutes of timing per K; evaluate's figures already checked",
    "eaglenest serve --port 8001 --baseline ngram": "a second server, for bench",
    "eaglenest bench --url http://127.0.0.1:8000 --baseline-url http://127.0.0.1:8001 --prompts "
    "data/eval/general.jsonl": "a load benchmark of half an hour on 2 cores",
}


def _script_steps() -> list[str]:
    """The commands the walkthrough runs as steps, with its variables at their defaults."""
    text = SCRIPT.read_text()
    defaults = {
        "EXPERIMENT": re.search(r'^EXPERIMENT="([^"]+)"', text, re.MULTILINE).group(1),
        "PORT": re.search(r'PORT="\$\{WALKTHROUGH_PORT:-(\d+)\}"', text).group(1),
        "BASE": "main",
    }  # the branch a clone of the repository checks out
    found = re.findall(r'\bstep [\w-]+ "([^"]+)"', text) + re.findall(r'\bCURRENT=[\w-]+ COMMAND="([^"]+)"', text)
    return [re.sub(r"\$(\w+)", lambda m: defaults[m.group(1)], command) for command in found]


def _readme_commands(sections: tuple[str, ...]) -> set[str]:
    readme, commands = (REPO / "README.md").read_text(), set()
    for part in readme.split("\n## ")[1:]:
        if f"## {part.splitlines()[0]}" not in sections:
            continue
        for start, language, lines in _fenced_blocks(part):
            if language == "bash":
                commands.update(command for _, command in _shell_commands(lines, start))
    return commands


def test_the_walkthrough_parses():
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_walkthrough_types_the_readmes_steps():
    steps = _script_steps()
    assert "make demo" in steps and any(step.startswith("eaglenest serve --port") for step in steps)
    readme = _readme_commands(WALKED_SECTIONS)
    everywhere = _readme_commands(tuple(re.findall(r"^## .*$", (REPO / "README.md").read_text(), re.MULTILINE)))
    strangers = [step for step in steps if step not in everywhere and step not in OWN_CHECKS]
    assert not strangers, f"the walkthrough runs steps the README does not show: {strangers}"
    missing = sorted(readme - set(steps) - set(NOT_WALKED))
    assert not missing, f"README commands the walkthrough does not run (run them or list them in NOT_WALKED): {missing}"
    assert set(NOT_WALKED) <= readme, (
        f"NOT_WALKED lists commands the README no longer shows: {set(NOT_WALKED) - readme}"
    )
