"""Exports load from anywhere: model paths absolute or inside the export, overrides, and normal file modes."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from clova_train.cli import main
from clova_train.core.atomic import write_json_atomic
from clova_train.core.errors import ExportError
from clova_train.core.manifest import staged_directory
from clova_train.tools.prompt_server import PromptToolServer
from helpers.common import fit_args, run_fit, serve_in_fresh_process

REQUEST_IMAGES = ["red/red_000.png", "purple/purple_000.png"]


@pytest.fixture(scope="module")
def relative_run(tiny_clip_dir: Path, concept_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run fitted from a working directory where the model is named by a *relative* path."""
    workdir = tmp_path_factory.mktemp("fit-cwd")
    shutil.copytree(tiny_clip_dir, workdir / "models" / "tiny-clip")
    run_dir = workdir / "run"
    saved = Path.cwd()
    os.chdir(workdir)
    try:
        args = fit_args(tiny_clip_dir, concept_root, run_dir, "--model.init_args.tool.init_args.model_name=local-dir:models/tiny-clip")
        assert run_fit(*args) == 0
    finally:
        os.chdir(saved)
    return run_dir


def classify(server: PromptToolServer, concept_root: Path) -> dict:
    return server.serve({"images": [str(concept_root / p) for p in REQUEST_IMAGES], "labels": ["red", "purple", "green"]})


def test_run_names_its_model_by_absolute_path(relative_run: Path) -> None:
    name = json.loads((relative_run / "tool.json").read_text())["init_args"]["model_name"]
    assert name == "local-dir:" + str((relative_run.parent / "models" / "tiny-clip").resolve())


def test_moved_export_loads_from_another_working_directory(
    relative_run: Path, concept_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = classify(PromptToolServer.from_export(relative_run), concept_root)
    assert main(["export", str(relative_run), "-o", str(tmp_path / "export")]) == 0
    moved = tmp_path / "elsewhere" / "export"
    shutil.move(str(tmp_path / "export"), moved)
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert classify(PromptToolServer.from_export(moved), concept_root) == expected


@pytest.mark.slow
def test_copy_base_export_needs_nothing_outside_it(relative_run: Path, concept_root: Path, tmp_path: Path) -> None:
    expected = classify(PromptToolServer.from_export(relative_run), concept_root)
    assert main(["export", str(relative_run), "-o", str(tmp_path / "export"), "--copy-base"]) == 0
    tool = json.loads((tmp_path / "export" / "tool.json").read_text())
    assert tool["base_in_export"] == "base" and (tmp_path / "export" / "base" / "open_clip_config.json").is_file()
    # Move the export and hide the original model: the copy inside the export must be what loads.
    moved = tmp_path / "moved"
    shutil.move(str(tmp_path / "export"), moved)
    original = relative_run.parent / "models" / "tiny-clip"
    hidden = original.with_name("hidden")
    original.rename(hidden)
    try:
        request = {"images": [str(concept_root / p) for p in REQUEST_IMAGES], "labels": ["red", "purple", "green"]}
        assert serve_in_fresh_process(moved, request) == expected
    finally:
        hidden.rename(original)


def test_base_model_override(relative_run: Path, concept_root: Path, tmp_path: Path, tiny_clip_dir: Path) -> None:
    expected = classify(PromptToolServer.from_export(relative_run), concept_root)
    assert main(["export", str(relative_run), "-o", str(tmp_path / "export")]) == 0
    tool_file = tmp_path / "export" / "tool.json"
    tool = json.loads(tool_file.read_text())
    tool["init_args"]["model_name"] = "local-dir:/nonexistent/tiny-clip"
    write_json_atomic(tool_file, tool)
    with pytest.raises(ExportError, match="/nonexistent/tiny-clip"):
        PromptToolServer.from_export(tmp_path / "export")
    served = PromptToolServer.from_export(tmp_path / "export", base_model=tiny_clip_dir)
    assert classify(served, concept_root) == expected
    with pytest.raises(ExportError, match="base model directory not found"):
        PromptToolServer.from_export(tmp_path / "export", base_model=tmp_path / "missing")


def test_copy_base_refuses_a_hub_model(relative_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    shutil.copytree(relative_run, run)
    tool = json.loads((run / "tool.json").read_text())
    tool["init_args"]["model_name"] = "ViT-L-14"
    write_json_atomic(run / "tool.json", tool)
    assert main(["export", str(run), "-o", str(tmp_path / "export"), "--copy-base"]) == 2
    assert "--copy-base needs the base model on disk" in capsys.readouterr().err
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_exports_get_the_modes_the_umask_gives(relative_run: Path, tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        assert main(["export", str(relative_run), "-o", str(tmp_path / "export"), "--copy-base"]) == 0
    finally:
        os.umask(old)
    entries = [tmp_path / "export", *(tmp_path / "export").rglob("*")]
    for entry in entries:
        mode = stat.S_IMODE(entry.stat().st_mode)
        assert mode == (0o777 if entry.is_dir() else 0o666) & ~umask, (entry, oct(mode))
    if umask == 0o022:  # what a server running as another user needs: read (and traverse) everything
        assert all(entry.stat().st_mode & stat.S_IROTH for entry in entries)


def test_staged_directory_respects_umask(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        with staged_directory(tmp_path / "out") as staging:
            write_json_atomic(staging / "a.json", {})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o750
    assert stat.S_IMODE((tmp_path / "out" / "a.json").stat().st_mode) == 0o640
