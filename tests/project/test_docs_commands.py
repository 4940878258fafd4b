"""Every shell command that README.md and docs/ show is checked: make targets exist; `clova-train` commands parse
(configs and arguments validated with ``--print_config``, the other subcommands' options exist in their ``--help``);
benchmark scripts and modules exist and take the options shown. The curl examples run against a live server in
tests/serving/test_http_serving.py."""

from __future__ import annotations

import functools
import importlib.util
import re
import shlex
import subprocess
import sys

import pytest

from helpers.common import REPO, run_cli_captured
from helpers.docs import documentation_files, shell_commands, without_comment

NOT_OURS = ("pip", "tensorboard", "vllm", "git", "cd", "export", "base64", "openssl")
PRINT_CONFIG_COMMANDS = ("fit", "validate", "test", "loop", "controller")


def documented_commands() -> list[tuple[str, str]]:
    found = []
    for path in documentation_files():
        for command in shell_commands(path):
            found.append((str(path.relative_to(REPO)), without_comment(command).replace(" ...", "")))
    readme = (REPO / "README.md").read_text()  # the learners table's commands are inline code
    found += [("README.md", span) for span in re.findall(r"`((?:clova-train|make) [^`<]+)`", readme)]  # no placeholders
    for path in documentation_files():  # benchmark runs and modules named in the text
        spans = re.findall(r"`(python (?:benchmarks/\S+\.py|-m clova_train\.\S+)[^`<]*)`", path.read_text())
        found += [(str(path.relative_to(REPO)), span) for span in spans]
    return found


COMMANDS = documented_commands()
CLI = [(where, c) for where, c in COMMANDS if c.startswith(("clova-train ", "python -m clova_train "))]


def words(command: str) -> list[str]:
    return shlex.split(command)


@functools.cache
def make_targets() -> set[str]:
    """The Makefile's explicit targets and ``demo-<tool>`` for every tool recipe (its ``demo-%`` rule)."""
    from clova_train.tools.recipes import tool_recipes

    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^demo-%:", makefile, re.M), "the Makefile has no demo-% rule for the tool recipes"
    return set(re.findall(r"^([a-z][\w-]*):", makefile, re.M)) | {f"demo-{name}" for name in tool_recipes()}


@functools.cache
def help_text(*subcommand: str) -> str:
    result = run_cli_captured([*subcommand, "--help"])
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def options(argv: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in argv if a.startswith("-") and a not in ("-", "--")]


def test_every_command_is_of_a_kind_the_checks_know() -> None:
    assert len(COMMANDS) > 40
    for where, command in COMMANDS:
        first = words(command)[0]
        assert first in ("make", "clova-train", "python", "curl", *NOT_OURS), (where, command)
        if first == "curl":
            assert where == "docs/http-api.md", f"{where}: curl examples belong in docs/http-api.md, which a test runs"


@pytest.mark.parametrize("where, command", [c for c in COMMANDS if c[1].startswith("make ")])
def test_make_targets_exist(where: str, command: str) -> None:
    for target in words(command)[1:]:
        assert target in make_targets(), f"{where}: `{command}`: the Makefile has no target {target!r}"


@pytest.mark.parametrize("where, command", [c for c in COMMANDS if c[1].startswith("python ")])
def test_python_scripts_and_modules_exist_with_their_options(where: str, command: str) -> None:
    argv = words(command)[1:]
    if argv[0] == "-m":
        assert importlib.util.find_spec(argv[1]) is not None, f"{where}: no module {argv[1]}"
        return
    script = REPO / argv[0]
    assert script.is_file(), f"{where}: `{command}`: no script {argv[0]}"
    shown = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, cwd=REPO,
                           timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    for option in options(argv[1:]):
        assert option in shown.stdout, f"{where}: `{command}`: {argv[0]} takes no {option}"


@pytest.mark.parametrize("where, command", [c for c in CLI if words(c[1])[1] not in PRINT_CONFIG_COMMANDS])
def test_other_subcommands_take_the_options_shown(where: str, command: str) -> None:
    argv = words(command)[1:] if command.startswith("clova-train") else words(command)[3:]
    if argv[0].startswith("-"):
        assert run_cli_captured(argv).returncode == 0, f"{where}: `{command}` fails"
        return
    text = help_text(argv[0])
    for option in options(argv[1:]):
        assert re.search(rf"(^|[\s,\[]){re.escape(option)}\b", text), f"{where}: `{command}`: {argv[0]} has no {option}"


@pytest.mark.slow
@pytest.mark.parametrize("where, command", [c for c in CLI if words(c[1])[1] in PRINT_CONFIG_COMMANDS])
def test_training_commands_parse_their_configs_and_arguments(where: str, command: str) -> None:
    """The config and every argument validated as the command would (``--print_config`` stops before any work)."""
    argv = words(command)[1:]
    if not any(a.endswith(".help") or a == "--help" for a in argv):
        argv.append("--print_config")
    result = run_cli_captured(argv)
    assert result.returncode == 0, f"{where}: `{command}`:\n{result.stderr[-2000:]}"
