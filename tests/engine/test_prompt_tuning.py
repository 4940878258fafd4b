"""The per-instance prompt-tuning engine, run through the CLI on a tiny CLIP (single process)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from clova_train.core.errors import ModelError
from clova_train.core.pool import PromptPool, control_pool
from helpers.common import fit_args, run_fit
from helpers.runs import assert_same_pools, load_run


def test_prompts_do_not_depend_on_chunk_size(tiny_clip_dir: Path, concept_root: Path, tmp_path: Path) -> None:
    runs = {}
    for size in (1, 8):
        run_dir = tmp_path / f"chunk{size}"
        assert run_fit(*fit_args(tiny_clip_dir, concept_root, run_dir, f"--data.init_args.chunk_size={size}")) == 0
        runs[size] = load_run(run_dir)
    (pool1, summary1), (pool8, summary8) = runs[1], runs[8]
    assert summary1["tried"] == summary8["tried"] == 16
    assert summary1["accepted"] > 0, "the test needs accepted prompts to compare"
    assert_same_pools(pool1, pool8)
    for x, y in zip(summary1["instances"], summary8["instances"]):
        assert (x["instance_id"], x["accepted"], x["rejections"]) == (y["instance_id"], y["accepted"], y["rejections"])
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-5)


def test_a_memory_budget_splits_chunks_without_changing_the_prompts(tiny_clip_dir: Path, concept_root: Path,
                                                                     tmp_path: Path, caplog, capsys) -> None:
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert run_fit(*fit_args(tiny_clip_dir, concept_root, whole, "--data.init_args.chunk_size=8")) == 0
    with caplog.at_level("INFO"):
        assert run_fit(*fit_args(tiny_clip_dir, concept_root, split, "--data.init_args.chunk_size=8",
                                 "--model.init_args.max_memory_gb=0.0001")) == 0  # 100 kB: a few instances a step
    (line,) = [r.getMessage() for r in caplog.records if "MB of activations per instance" in r.getMessage()]
    fitting = int(line.split(" fits ")[1].split()[0])
    assert 1 <= fitting < 8, line
    assert "saved by dtype in the measured step: float32 " in line, line
    (pool_a, summary_a), (pool_b, summary_b) = load_run(whole), load_run(split)
    assert_same_pools(pool_a, pool_b)
    for x, y in zip(summary_a["instances"], summary_b["instances"]):
        assert (x["instance_id"], x["accepted"]) == (y["instance_id"], y["accepted"])
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-5)
    capsys.readouterr()
    assert run_fit(*fit_args(tiny_clip_dir, concept_root, tmp_path / "bad", "--model.init_args.max_memory_gb=0")) == 2
    assert "max_memory_gb must be a positive number of GB" in capsys.readouterr().err


def test_run_writes_pool_summary_and_tool(tiny_clip_dir: Path, concept_root: Path, tmp_path: Path) -> None:
    assert run_fit(*fit_args(tiny_clip_dir, concept_root, tmp_path)) == 0
    pool, summary = load_run(tmp_path)
    tool = json.loads((tmp_path / "tool.json").read_text())
    assert summary["complete"] and summary["tried"] == summary["accepted"] + summary["rejected"] == 16
    assert len(pool) == summary["accepted"]
    assert set(summary["per_concept"]) == {"red", "green", "blue", "purple"}
    assert tool["prompt_shape"] == [3, 4, 64] and pool.spec.model_identity == tool["identity"]
    for record in summary["instances"]:
        assert record["accepted"] == (record["rejections"] == [])
        assert all(set(r) == {"kind", "detail"} for r in record["rejections"])
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


def test_existing_pool_is_merged_not_lost(tiny_clip_dir: Path, concept_root: Path, tmp_path: Path) -> None:
    first = tmp_path / "first"
    assert run_fit(*fit_args(tiny_clip_dir, concept_root, first, "--data.init_args.concepts=[red, green]",
                             "--data.init_args.negatives_root=null")) == 0
    first_pool, _ = load_run(first)
    pool_path = tmp_path / "shared" / "pool.safetensors"
    pool_path.parent.mkdir()
    shutil.copy(first / "pool.safetensors", pool_path)
    second = tmp_path / "second"
    assert run_fit(*fit_args(tiny_clip_dir, concept_root, second, "--data.init_args.concepts=[blue, purple]",
                             f"--model.init_args.pool_path={pool_path}")) == 0
    merged = PromptPool.load(pool_path)
    second_pool, second_summary = load_run(second)  # the run directory keeps its own pool and summary
    assert set(first_pool.concepts) <= set(merged.concepts)
    assert len(merged) == len(first_pool) + second_summary["accepted"] == len(first_pool) + len(second_pool)
    # nothing else written there but the lock that merges hold (core.pool.pool_lock)
    assert sorted(p.name for p in pool_path.parent.iterdir()) == [".pool.safetensors.lock", "pool.safetensors"]
    from clova_train.cli import main

    assert main(["export", str(second), "-o", str(tmp_path / "export")]) == 0
    assert len(PromptPool.load(tmp_path / "export" / "pool.safetensors")) == len(second_pool)


def test_runs_sharing_a_run_directory_keep_each_others_records(tiny_clip_dir: Path, concept_root: Path,
                                                               tmp_path: Path) -> None:
    for concepts in ("[red, green]", "[blue, purple]"):
        assert run_fit(*fit_args(tiny_clip_dir, concept_root, tmp_path, f"--data.init_args.concepts={concepts}",
                                 "--data.init_args.negatives_root=null")) == 0
    pool, summary = load_run(tmp_path)
    assert set(summary["per_concept"]) == {"red", "green", "blue", "purple"}
    assert summary["tried"] == len(summary["instances"]) == 16 and summary["tried"] == summary["accepted"] + summary["rejected"]
    assert len(pool) == summary["accepted"] and set(pool.concepts) <= set(summary["per_concept"])
    assert len({item["instance_id"] for item in summary["instances"]}) == 16


def test_a_pool_of_another_model_in_the_run_directory_is_refused_or_overwritten(
        tiny_clip_dir: Path, concept_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from clova_train.core.pool import PoolSpec

    run = tmp_path / "run"
    run.mkdir()
    foreign = PromptPool(PoolSpec("clip", "clip:another-model", (4, 8), 8))
    foreign.add("red", torch.ones(1, 8), torch.ones(1, 4, 8), ["elsewhere"])
    foreign.save(run / "pool.safetensors")
    args = fit_args(tiny_clip_dir, concept_root, run, "--data.init_args.concepts=[red]", "--data.init_args.negatives_root=null")
    assert run_fit(*args) != 0  # merging into it is refused, with the pool named...
    assert "pool.safetensors" in capsys.readouterr().err
    assert PromptPool.load(run / "pool.safetensors").spec.model_identity == "clip:another-model"  # ...and kept
    assert run_fit(*args, "--model.init_args.on_existing_pool=overwrite") == 0  # a user's explicit choice
    assert PromptPool.load(run / "pool.safetensors").spec.model_identity != "clip:another-model"


def gate_fixture(root: Path, tmp: Path, mislabel: bool) -> Path:
    """red/green/blue folders; optionally one green image placed (mislabelled) in red's training set."""
    data = tmp / ("mislabelled" if mislabel else "clean")
    shutil.copytree(root, data)
    shutil.rmtree(data / "purple")
    if mislabel:
        for image in sorted((data / "red").glob("*.png"))[2:]:
            image.unlink()
        shutil.copy(sorted((data / "green").glob("*.png"))[3], data / "red" / "red_zz_mislabelled.png")
    return data


def test_gate_rejects_wrong_label_and_accepts_clean(tiny_clip_dir: Path, concept_root: Path, tmp_path: Path) -> None:
    data = gate_fixture(concept_root, tmp_path, mislabel=True)
    common = ("--data.init_args.concepts=[red]", "--data.init_args.val_negatives_per_instance=8",
              "--model.init_args.steps=30")
    run_dir = tmp_path / "mislabelled_run"
    assert run_fit(*fit_args(tiny_clip_dir, data, run_dir, *common)) == 0
    _, summary = load_run(run_dir)
    (record,) = summary["instances"]
    assert record["instance_id"] == "red/red_zz_mislabelled.png"
    assert not record["accepted"]
    assert {r["kind"] for r in record["rejections"]} <= {"held-out positive", "held-out negative"}
    assert record["rejections"]

    clean = gate_fixture(concept_root, tmp_path, mislabel=False)
    run_dir = tmp_path / "clean_run"
    assert run_fit(*fit_args(tiny_clip_dir, clean, run_dir, *common)) == 0
    _, summary = load_run(run_dir)
    assert summary["tried"] == 4 and summary["accepted"] >= 3


def test_gate_negatives_catch_prompt_that_pulls_everything(tiny_clip_dir: Path, concept_root: Path, tmp_path: Path) -> None:
    """Trained on positives only, a prompt maps every image to the concept: only the negative check sees it.

    Judged by the prompted forward alone: the serving rule (in the default ``both``) also rejects some of these
    prompts on a positive, which this test is not about."""
    common = ("--data.init_args.concepts=[purple]", "--data.init_args.negatives_per_instance=0",
              "--data.init_args.val_negatives_per_instance=6", "--model.init_args.steps=40",
              "--model.init_args.lr=0.05", "--model.init_args.tool.init_args.gate_decision=prompted")
    positives_only = tmp_path / "positives_only"
    assert run_fit(*fit_args(tiny_clip_dir, concept_root, positives_only, *common,
                             "--model.init_args.tool.init_args.gate_negatives=false")) == 0
    with_negatives = tmp_path / "with_negatives"
    assert run_fit(*fit_args(tiny_clip_dir, concept_root, with_negatives, *common)) == 0
    _, loose = load_run(positives_only)
    _, strict = load_run(with_negatives)
    assert loose["accepted"] == loose["tried"] == 4
    assert strict["accepted"] < loose["accepted"]
    assert strict["rejection_reasons"].get("held-out negative", 0) > 0


def test_early_stop_freezes_passed_instances(tiny_clip_dir: Path, concept_root: Path, tmp_path: Path) -> None:
    full, early = tmp_path / "full", tmp_path / "early"
    assert run_fit(*fit_args(tiny_clip_dir, concept_root, full, "--data.init_args.concepts=[red]")) == 0
    assert run_fit(*fit_args(tiny_clip_dir, concept_root, early, "--data.init_args.concepts=[red]",
                             "--model.init_args.early_stop_every=5")) == 0
    _, full_summary = load_run(full)
    _, early_summary = load_run(early)
    assert early_summary["accepted"] >= full_summary["accepted"] > 0
    # Instances that passed after 5 steps keep their 5-step prompt, so they differ from the 15-step ones.
    full_pool, early_pool = PromptPool.load(full / "pool.safetensors"), PromptPool.load(early / "pool.safetensors")
    assert not torch.allclose(full_pool.entry("red")[1][0], early_pool.entry("red")[1][0])


def test_validate_and_test_report_accuracy_with_and_without_pool(
    tiny_clip_dir: Path, concept_root: Path, tmp_path: Path
) -> None:
    from lightning import Trainer

    from clova_train.datamodules import ConceptFolderDataModule
    from clova_train.tools.images import list_images, load_image
    from clova_train.tools.clip.synthetic import write_concept_folders
    from clova_train.models import PromptTuning
    from clova_train.tools.clip.tool import PromptedClip
    from clova_train.tools.prompt_server import PromptToolServer

    assert run_fit(*fit_args(tiny_clip_dir, concept_root, tmp_path, "--model.init_args.steps=30")) == 0
    test_root = write_concept_folders(tmp_path / "test", ["red", "green", "blue", "purple"], 3, 32, seed=99)
    module = PromptTuning(PromptedClip(f"local-dir:{tiny_clip_dir}", None, num_prompt_tokens=4),
                          evaluation_controls=["zero_prompt", "random_prompt", "ungated"])
    dm = ConceptFolderDataModule(str(concept_root), image_size=32, val_per_concept=2, test_root=str(test_root))
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, default_root_dir=str(tmp_path))
    (val,) = trainer.validate(module, dm)
    (test,) = trainer.test(module, dm)

    server = PromptToolServer.from_export(tmp_path)  # the run dir has pool.safetensors and tool.json
    names = ["blue", "green", "purple", "red"]
    for metrics, files in (
        (val, [(p, c) for c in names for p in list_images(concept_root / c)[:2]]),
        (test, [(p, c) for c in names for p in list_images(test_root / c)]),
    ):
        images = torch.stack([load_image(p, 32) for p, _ in files])
        predicted, _ = server.classify(images, names)
        expected = sum(p == c for p, (_, c) in zip(predicted, files)) / len(files)
        stage = "val" if metrics is val else "test"
        assert metrics[f"{stage}/accuracy_pool"] == pytest.approx(expected)
        base = (server.tool.encode_image(images) @ server.tool.encode_text(names).T).argmax(-1)
        base_expected = sum(names[i] == c for i, (_, c) in zip(base.tolist(), files)) / len(files)
        assert metrics[f"{stage}/accuracy_no_prompt"] == pytest.approx(base_expected)
        # the zero-prompt control: the same pool entries with every prompt zero, through the same serving code
        zero = PromptToolServer(server.tool, control_pool(server.pool, "zero"))
        zero_predicted, _ = zero.classify(images, names)
        zero_correct = [p == c for p, (_, c) in zip(zero_predicted, files)]
        assert metrics[f"{stage}/accuracy_zero_prompt"] == pytest.approx(sum(zero_correct) / len(files))
        assert zero_predicted == [names[i] for i in base.tolist()]  # a zero prompt is the unmodified tool
        random_predicted, _ = PromptToolServer(server.tool, control_pool(server.pool, "random", 0)).classify(images, names)
        random_correct = sum(p == c for p, (_, c) in zip(random_predicted, files)) / len(files)
        assert metrics[f"{stage}/accuracy_random_prompt"] == pytest.approx(random_correct)
        assert f"{stage}/accuracy_ungated" not in metrics  # no rejected prompts kept: nothing to score
        # the per-concept report: every image once, per-concept means that add up to the logged ones
        report = json.loads((tmp_path / "evaluation" / f"{'validate' if stage == 'val' else 'test'}.json").read_text())
        rows = {row["concept"]: row for row in report["per_concept"]}
        assert set(rows) == {*names, "all"} and rows["all"]["n"] == len(files)
        assert sum(rows[c]["n"] for c in names) == len(files)
        for concept in names:
            hits = [z for z, (_, c) in zip(zero_correct, files) if c == concept]
            assert rows[concept]["accuracy_zero_prompt"]["mean"] == pytest.approx(sum(hits) / len(hits))
            low, high = rows[concept]["accuracy_pool"]["ci95"]
            assert 0.0 <= low <= rows[concept]["accuracy_pool"]["mean"] <= high <= 1.0
        assert rows["all"]["accuracy_pool"]["mean"] == pytest.approx(expected)
        difference = rows["all"]["accuracy_pool - accuracy_zero_prompt"]
        assert difference["mean"] == pytest.approx(expected - sum(zero_correct) / len(files))


def test_ungated_control_holds_every_tuned_prompt(tiny_clip_dir: Path) -> None:
    from clova_train.models import PromptTuning
    from clova_train.tools.clip.tool import PromptedClip
    from clova_train.tools.contracts import InstanceRecord, Rejection

    tool = PromptedClip(f"local-dir:{tiny_clip_dir}", None, num_prompt_tokens=2, prompt_depth=1)
    module = PromptTuning(tool, keep_rejected_prompts=True)
    shape, dim = tool.prompt_shape, tool.feature_dim

    def record(name: str, accepted: bool, keep: bool = True) -> InstanceRecord:
        return InstanceRecord(name, "red", accepted, [] if accepted else [Rejection("held-out positive", "x")],
                              feature=torch.randn(dim) if keep else None, prompt=torch.randn(shape) if keep else None)

    module.records = {"a": record("a", True)}
    assert module.ungated_pool() is None  # nothing rejected: the ungated pool would be the pool
    module.records.update(b=record("b", False), c=record("c", False, keep=False))
    ungated = module.ungated_pool()
    assert ungated.entry("red")[2] == ["a", "b"] and module.build_pool().entry("red")[2] == ["a"]
    torch.testing.assert_close(ungated.entry("red")[1][1], module.records["b"].prompt)
    with pytest.raises(ModelError, match="evaluation_controls: unknown control"):
        PromptTuning(tool, evaluation_controls=["zero_prompt", "random"])


def test_empty_pool_is_the_unmodified_tool(tiny_clip_dir: Path, concept_root: Path, tmp_path: Path) -> None:
    from lightning import Trainer

    from clova_train.datamodules import ConceptFolderDataModule
    from clova_train.models import PromptTuning
    from clova_train.tools.clip.tool import PromptedClip

    module = PromptTuning(PromptedClip(f"local-dir:{tiny_clip_dir}", None, num_prompt_tokens=4), pool_path=str(tmp_path / "none.safetensors"))
    dm = ConceptFolderDataModule(str(concept_root), image_size=32, val_per_concept=2)
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, default_root_dir=str(tmp_path))
    (val,) = trainer.validate(module, dm)
    assert val["val/accuracy_pool"] == val["val/accuracy_no_prompt"]
