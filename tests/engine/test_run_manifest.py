"""One record of what a run or export is (``run.json``, an export's ``export.json``), read through one function by
export, serve and report; folders written before it are recognised by their files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clova_train.cli import main
from clova_train.core.errors import ClovaTrainError, DataError
from clova_train.core.run_manifest import RUN_KINDS, read_run_manifest, write_run_manifest
from clova_train.report.runs import run_kind
from clova_train.serving.http import export_kind


def test_a_written_manifest_reads_back_with_versions_and_digest(tmp_path: Path) -> None:
    write_run_manifest(tmp_path, "prompt_tuning", "clip", "models.PromptTuning", "model: {}\n")
    run = read_run_manifest(tmp_path)
    assert (run.kind, run.tool, run.learner, run.exported, run.legacy) == (
        "prompt_tuning", "clip", "models.PromptTuning", False, False)
    assert run.config_digest.startswith("sha256:") and "torch" in run.versions and "python" in run.versions
    write_run_manifest(tmp_path, "prompt_tuning", "clip", "models.PromptTuning", "model: {lr: 1}\n")  # a rerun
    assert read_run_manifest(tmp_path).config_digest != run.config_digest


@pytest.mark.parametrize("kind, tool", [("lora", None), ("prompt_tuning", "vqa")])
def test_a_directory_holding_another_learners_run_is_refused(tmp_path: Path, kind: str, tool: str | None) -> None:
    write_run_manifest(tmp_path, "prompt_tuning", "clip")
    with pytest.raises(DataError, match="already holds a prompt_tuning \\(clip\\) run"):
        write_run_manifest(tmp_path, kind, tool)
    assert read_run_manifest(tmp_path).tool == "clip"


@pytest.mark.parametrize("files, kind", [
    (["adapter/adapter_config.json"], "lora"),
    (["controller.zip"], "controller"),
    (["logs/progress.csv"], "controller"),
    (["summary.json"], "prompt_tuning"),
    (["pool.safetensors", "tool.json"], "prompt_tuning"),
    (["journal.jsonl"], "closed_loop"),
])
def test_directories_written_before_manifests_are_recognised_by_their_files(tmp_path: Path, files: list[str],
                                                                            kind: str) -> None:
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}")
    run = read_run_manifest(tmp_path)
    assert (run.kind, run.legacy) == (kind, True)


@pytest.mark.parametrize("learner, kind", [("prompt_tool", "prompt_tuning"), ("lora_tool_llm", "lora"),
                                           ("controller", "controller")])
def test_exports_written_before_manifests_name_their_learner(tmp_path: Path, learner: str, kind: str) -> None:
    (tmp_path / "export.json").write_text(json.dumps({"format_version": 1, "learner": learner}))
    run = read_run_manifest(tmp_path)
    assert (run.kind, run.exported) == (kind, True)


@pytest.mark.parametrize("record, words", [
    ({"kind": "rocket"}, "'kind' must be one of"),
    ({"kind": "lora", "tool": 3}, "'tool' must be text or null"),
    ({"kind": "lora", "versions": []}, "'versions' must be an object"),
    ([1, 2], "must hold a JSON object"),
])
def test_a_bad_manifest_is_one_error_naming_it(tmp_path: Path, record: object, words: str) -> None:
    (tmp_path / "run.json").write_text(json.dumps(record))
    with pytest.raises(DataError, match=words) as caught:
        read_run_manifest(tmp_path)
    assert "run.json" in str(caught.value)


def test_a_directory_that_is_nothing_is_named(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="neither a run nor an export"):
        read_run_manifest(tmp_path)
    with pytest.raises(DataError, match="not found"):
        read_run_manifest(tmp_path / "missing")
    assert set(RUN_KINDS) >= {"prompt_tuning", "lora", "controller", "closed_loop"}


def test_export_serve_and_report_read_the_same_manifest(tmp_path: Path) -> None:
    write_run_manifest(tmp_path / "loop", "closed_loop")
    write_run_manifest(tmp_path / "controller", "controller")
    assert run_kind(tmp_path / "controller") == "controller"
    with pytest.raises(DataError, match="closed_loop run, which this report does not draw"):
        run_kind(tmp_path / "loop")
    for name, words in (("loop", "closed_loop run"), ("controller", "clova-train controller export")):
        with pytest.raises(ClovaTrainError, match=words):
            export_kind(tmp_path / name) if name == "loop" else None
            from clova_train.export import export_run

            export_run(tmp_path / name, tmp_path / f"{name}-export")
        assert not (tmp_path / f"{name}-export").exists()


def test_a_fit_writes_its_manifest_and_its_export_carries_it(clip_export: Path, capsys) -> None:
    run_dir = clip_export.with_name(clip_export.name.removesuffix("-export"))
    run = read_run_manifest(run_dir)
    assert (run.kind, run.tool, run.exported) == ("prompt_tuning", "clip", False)
    assert run.learner == "models.prompt_tuning.ClipPromptTuning" or run.learner.endswith("PromptTuning")
    exported = json.loads((clip_export / "export.json").read_text())
    assert (exported["kind"], exported["tool"], exported["learner"]) == ("prompt_tuning", "clip", "prompt_tool")
    assert exported["config_digest"] == run.config_digest and exported["run"]["versions"] == run.versions
    assert export_kind(clip_export) == "prompt_tool" and export_kind(run_dir) == "prompt_tool"
    assert main(["report", str(run_dir), "--output", str(run_dir.parent / "manifest-report")]) == 0
