"""Rules of the code's shape that hold from now on, each read from the source tree."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A command module longer than this mixes concerns: split it by concern (as commands/bench and commands/remote are).
MAX_COMMAND_MODULE_LINES = 400


def test_no_command_module_is_over_400_lines() -> None:
    commands = REPO / "src" / "eaglenest" / "commands"
    long = {str(path.relative_to(REPO)): count for path in sorted(commands.rglob("*.py"))
            if (count := len(path.read_text().splitlines())) > MAX_COMMAND_MODULE_LINES}
    assert not long, f"over {MAX_COMMAND_MODULE_LINES} lines (split by concern): {long}"
