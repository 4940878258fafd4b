"""The commands the documentation shows (README.md and docs/), read from its fenced code blocks."""

from __future__ import annotations

import re
from pathlib import Path

from helpers.common import REPO

SHELL_LANGUAGES = ("bash", "sh", "shell", "console")
_FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.S | re.M)


def documentation_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def code_blocks(path: Path, languages: tuple[str, ...]) -> list[str]:
    return [body for language, body in _FENCE.findall(path.read_text()) if language in languages]


def shell_commands(path: Path) -> list[str]:
    """Each command of the file's shell blocks: continuation lines joined, comments and prompts dropped."""
    commands = []
    for block in code_blocks(path, SHELL_LANGUAGES):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.strip().removeprefix("$ ")
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def without_comment(command: str) -> str:
    """``command`` without a trailing ``# ...`` comment (outside quotes)."""
    quote = None
    for i, char in enumerate(command):
        if char in "'\"" and quote in (None, char):
            quote = None if quote == char else char
        elif char == "#" and quote is None and (i == 0 or command[i - 1].isspace()):
            return command[:i].rstrip()
    return command
