"""Options as users type them: spelled out in full, a suggestion for a misspelled one, defaults in --help,
--version, and progress lines when output is not a terminal."""

from __future__ import annotations

import io

import pytest

from clova_train.core.command_line import with_suggestions
from helpers.common import REPO, run_fit

CLIP = str(REPO / "configs/quickstart/clip_prompt.yaml")
CONTROLLER = str(REPO / "configs/quickstart/controller_dqn.yaml")


def test_a_prefix_of_a_lightning_option_is_refused_with_the_option_it_meant(capsys: pytest.CaptureFixture) -> None:
    assert run_fit("fit", "--config", CLIP, "--trainer.max_epoch", "2", "--print_config") == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --trainer.max_epoch 2" in err
    assert "--trainer.max_epoch: did you mean --trainer.max_epochs" in err


@pytest.mark.parametrize(("args", "hint"), [
    (["controller", "fit", "--config", CONTROLLER, "--train.total_timestep", "5"],
     "--train.total_timestep: did you mean --train.total_timesteps?"),
    (["serve", "x", "--top_k", "3"], "--top_k: did you mean --top-k?"),
    (["serve", "x", "--max-batch", "3"], "unrecognized arguments: --max-batch 3"),  # a prefix is not accepted
    (["predict", "x", "--inputs", "i", "--output", "o", "--feld", "a=b"], "--feld: did you mean --field?"),
])
def test_other_commands_refuse_prefixes_and_suggest(args: list[str], hint: str, capsys: pytest.CaptureFixture) -> None:
    assert run_fit(*args) == 2
    assert hint in capsys.readouterr().err


def test_help_shows_defaults_and_version_prints_the_package_version(capsys: pytest.CaptureFixture) -> None:
    assert run_fit("serve", "--help") == 0
    out = capsys.readouterr().out
    out = " ".join(out.split())  # help wraps lines
    assert "(default: 8000)" in out and "(default: 127.0.0.1)" in out
    assert "(default: None)" not in out and "(default: False)" not in out  # options without a default say nothing
    assert run_fit("tiny-model", "--help") == 0
    assert "(default: 0)" in " ".join(capsys.readouterr().out.split())  # --seed: a default of 0 is a default
    assert run_fit("--version") == 0
    assert capsys.readouterr().out.startswith("clova-train ")


def test_suggestions_only_for_close_names() -> None:
    assert with_suggestions("unrecognized arguments: --zzz", ["--port"]) == "unrecognized arguments: --zzz"
    assert with_suggestions("the following arguments are required: --output", ["--output"]) == \
        "the following arguments are required: --output"
    assert "did you mean --port?" in with_suggestions("unrecognized arguments: --prot=1", ["--port", "--host"])
    assert with_suggestions("unrecognized arguments: runs/a-port", ["--port"]) == "unrecognized arguments: runs/a-port"


def test_long_steps_log_progress_lines_when_not_on_a_terminal(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from clova_train.core import progress
    from clova_train.export.common import copy_tree
    from clova_train.tools import tiny_common as common

    stream = io.StringIO()
    monkeypatch.setattr(progress, "LOG_EVERY_SECONDS", 0.0)
    monkeypatch.setattr("sys.stderr", stream)
    assert list(common.pretraining_steps(3, "CLIP")) == [0, 1, 2]
    lines = stream.getvalue().splitlines()
    assert lines[-1].startswith("pretraining tiny CLIP: 3/3 steps") and len(lines) == 3
    # copying a base model into an export (--copy-base): gigabytes, so lines in MB
    source = tmp_path / "model"
    source.mkdir()
    for name in ("a.safetensors", "b.safetensors"):
        with (source / name).open("wb") as handle:
            handle.truncate(40 << 20)
    copy_tree(source, tmp_path / "copy")
    assert stream.getvalue().splitlines()[-1].startswith("copying model: 84 MB/84 MB, ")
