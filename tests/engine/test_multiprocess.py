"""Multi-process paths of the prompt-tuning engine, tested for real on a tiny CLIP (the cheap tool; the other tools
share this code): DDP on CPU (gloo) with even and uneven chunk splits, fewer instances than ranks, and a run killed
with SIGKILL then resumed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from clova_train.models.prompt_tuning import PromptTuning
from clova_train.tools.clip.tiny import make_tiny_clip
from helpers.common import fit_args, run_cli_subprocess, run_fit
from helpers.kill import kill_at_chunk
from helpers.runs import assert_same_pools, load_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference_run(tiny_clip_dir: Path, concept_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted single-process run."""
    run_dir = tmp_path_factory.mktemp("reference")
    assert run_fit(*fit_args(tiny_clip_dir, concept_root, run_dir)) == 0
    return run_dir


def test_ddp_two_ranks_match_one_device(tiny_clip_dir: Path, concept_root: Path, reference_run: Path, tmp_path: Path) -> None:
    """16 instances in chunks of 6: 3 chunks on 2 ranks (one rank pads with an empty chunk), vs chunks of 4 on one."""
    args = fit_args(tiny_clip_dir, concept_root, tmp_path, "--trainer.devices=2", "--trainer.strategy=ddp",
                    "--data.init_args.chunk_size=6")
    result = run_cli_subprocess(args)
    assert result.returncode == 0, result.stderr[-3000:]
    pool, summary = load_run(tmp_path)
    reference_pool, reference_summary = load_run(reference_run)
    assert summary["tried"] == 16  # both ranks' instances reached rank 0
    assert [(r["instance_id"], r["accepted"], r["steps"]) for r in summary["instances"]] == [
        (r["instance_id"], r["accepted"], r["steps"]) for r in reference_summary["instances"]]
    assert_same_pools(pool, reference_pool)
    ids = [i for c in pool.concepts for i in pool.entry(c)[2]]
    assert len(ids) == len(set(ids)) == summary["accepted"]
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["pool.safetensors"]
    assert (result.stdout + result.stderr).count("Prompt pool:") == 1


@pytest.mark.parametrize(
    ("instances", "chunk_size"), [(2, 2), (1, 1)], ids=["1-chunk-on-2-ranks", "fewer-instances-than-ranks"])
def test_ddp_edge_splits_match_one_device(instances: int, chunk_size: int, tiny_clip_dir: Path, concept_root: Path,
                                          tmp_path: Path) -> None:
    """One chunk for two ranks, and one instance for two ranks: a rank with nothing to tune still takes part."""
    # red's 6 images with 6 - instances held out leave `instances` to tune; the other concepts are negatives
    split = ["--data.init_args.concepts=[red]", f"--data.init_args.val_per_concept={6 - instances}",
             f"--data.init_args.chunk_size={chunk_size}"]
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    assert run_fit(*fit_args(tiny_clip_dir, concept_root, single, *split)) == 0
    result = run_cli_subprocess(fit_args(tiny_clip_dir, concept_root, ddp, *split, "--trainer.devices=2",
                                         "--trainer.strategy=ddp"))
    assert result.returncode == 0, result.stderr[-3000:]
    (pool, summary), (reference_pool, reference) = load_run(ddp), load_run(single)
    assert summary["tried"] == instances
    assert [(r["instance_id"], r["accepted"], r["steps"]) for r in summary["instances"]] == [
        (r["instance_id"], r["accepted"], r["steps"]) for r in reference["instances"]]
    assert_same_pools(pool, reference_pool)
    assert (result.stdout + result.stderr).count("Prompt pool:") == 1


def test_killed_run_resumes_to_the_same_pool(
    tiny_clip_dir: Path, concept_root: Path, reference_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = run_cli_subprocess(fit_args(tiny_clip_dir, concept_root, tmp_path, kill_at_chunk(2)))
    assert result.returncode == -9, result.stderr[-3000:]
    assert not (tmp_path / "pool.safetensors").exists()  # no partial pool
    checkpoint = tmp_path / "checkpoints" / "last.ckpt"
    assert checkpoint.is_file()

    tuned: list[str] = []
    original = PromptTuning.tune_chunk

    def spy(self, chunk):
        tuned.extend(item.instance_id for item in chunk)
        return original(self, chunk)

    monkeypatch.setattr(PromptTuning, "tune_chunk", spy)
    assert run_fit(*fit_args(tiny_clip_dir, concept_root, tmp_path, f"--ckpt_path={checkpoint}")) == 0
    assert len(tuned) == 8, "the resumed run must tune only the 8 instances the killed run had not finished"
    pool, summary = load_run(tmp_path)
    reference_pool, reference_summary = load_run(reference_run)
    assert summary["tried"] == 16
    assert [(r["instance_id"], r["accepted"]) for r in summary["instances"]] == [
        (r["instance_id"], r["accepted"]) for r in reference_summary["instances"]
    ]
    assert_same_pools(pool, reference_pool)


def test_resume_refuses_checkpoint_of_other_weights(
    tiny_clip_dir: Path, concept_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The weights behind a model path changed between the killed run and the resume: refuse, keep files."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_clip_dir, model_dir)
    run_dir = tmp_path / "run"
    assert run_cli_subprocess(fit_args(model_dir, concept_root, run_dir, kill_at_chunk(1))).returncode == -9
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    saved = checkpoint.read_bytes()

    make_tiny_clip(model_dir, seed=1, pretrain_steps=0)
    assert run_fit(*fit_args(model_dir, concept_root, run_dir, f"--ckpt_path={checkpoint}")) == 2
    err = capsys.readouterr().err
    assert "clova-train: error: checkpoint was written for tool open_clip:" in err
    assert not (run_dir / "pool.safetensors").exists()
    assert checkpoint.read_bytes() == saved
