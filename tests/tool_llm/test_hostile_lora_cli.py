"""A LoRA export's hostile files through the commands a user runs on them (issue 53): ``clova-train export`` of a run
and ``clova-train serve`` of an export, each in a child under a time and memory bound (:mod:`helpers.contained`),
every case with both commands. A template that loops, recurses, builds a 4 GB string, raises, does not parse or
tries to escape the sandbox, a 100 MB template, a tokenizer regex that panics and an adapter config of 10^6
replicated layers are each one error line naming the file, exit 2, no traceback; a case that escaped its bound would
be killed (timeout, memory, signal), not hang or abort the test worker.

About 30 s on 2 cores (the forkserver's imports, then a second or so a case: the template probe's own child), so it
is marked ``learning`` (``make test-learning``); the 15-minute suite runs one command per kind of case
(``tests/project/test_hostile_run_files.py``), and the finer points in-process
(``tests/tool_llm/test_hostile_lora_files.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.hostile_lora_export import COMMANDS, HOSTILE_FILES, run_hostile_case, write_tiny_lora_export

pytestmark = pytest.mark.learning


@pytest.fixture(scope="module")
def tiny_lora_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_lora_export(tmp_path_factory.mktemp("lora") / "export")


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("case", list(HOSTILE_FILES))
def test_a_hostile_export_file_is_one_error_of_the_users_command_contained(tiny_lora_export: Path, tmp_path: Path,
                                                                            case: str, command: str) -> None:
    from helpers.contained import assert_one_clean_error

    outcome, words = run_hostile_case(tiny_lora_export, tmp_path, case, command)
    assert_one_clean_error(outcome, *words)
