"""LOC and SEG runs through the CLI: two DDP processes (uneven chunk split) match one process, and a run
killed between chunks resumes to the same pool; the pool is written once."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import QUIET_CPU_FIT, run_cli_subprocess, run_fit
from test_prompt_tuning import assert_killed_run_resumes_to, assert_same_pools, load_run

TOOL_ARGS = {
    "loc": ["--model.init_args.tool.class_path=clova_train.tools.owlvit_loc.OwlVitLoc",
            "--model.init_args.tool.init_args.num_prompt_tokens=64"],
    "seg": ["--model.init_args.tool.class_path=clova_train.tools.maskformer_seg.MaskFormerSeg",
            "--model.init_args.tool.init_args.num_prompt_tokens=16",
            "--model.init_args.tool.init_args.object_threshold=0.0"],
}


# (model fixture, scenes fixture, concept the tiny model can learn)
RUNS = {"loc": ("pretrained_owlvit_dir", "loc_scenes", "purple circle"),
        "seg": ("pretrained_maskformer_dir", "seg_scenes", "red circle")}
# Prompts agree to float summation order: processes with other thread counts add in another order, and
# SEG's Adam at lr 0.1 over 100 steps carries those last bits further (prompt entries are of order 1).
PROMPT_ATOL = {"loc": 1e-5, "seg": 1e-4}


@pytest.fixture(params=["loc", "seg"])
def tool_run(request: pytest.FixtureRequest) -> tuple[str, Path, Path, str]:
    model, scenes, concept = RUNS[request.param]
    return request.param, request.getfixturevalue(model), request.getfixturevalue(scenes), concept


def grounding_args(run: tuple[str, Path, Path, str], run_dir: Path, *extra: str) -> list[str]:
    tool, model_dir, scenes, concept = run
    return [
        *QUIET_CPU_FIT,
        f"--trainer.default_root_dir={run_dir}",
        "--model.class_path=clova_train.models.PromptTuning",
        *TOOL_ARGS[tool],
        f"--model.init_args.tool.init_args.model_name={model_dir}",
        "--model.init_args.lr=0.1", "--model.init_args.steps=100", "--model.init_args.early_stop_every=10",
        "--data.class_path=clova_train.datamodules.GroundingDataModule",
        f"--data.init_args.annotations={scenes / 'annotations.json'}",
        f"--data.init_args.concept={concept}",
        "--data.init_args.max_images=8", "--data.init_args.num_val_images=4",
        "--data.init_args.chunk_size=3",  # 8 instances: chunks of 3, 3, 2; rank 0 gets two of them
        *extra,
    ]


@pytest.fixture
def reference_run(tool_run: tuple[str, Path, Path, str], tmp_path: Path) -> Path:
    run_dir = tmp_path / "single"
    assert run_fit(*grounding_args(tool_run, run_dir)) == 0
    return run_dir


def test_ddp_two_ranks_match_one_device(tool_run: tuple[str, Path, Path, str], reference_run: Path,
                                        tmp_path: Path) -> None:
    result = run_cli_subprocess(grounding_args(tool_run, tmp_path / "ddp", "--trainer.devices=2",
                                               "--trainer.strategy=ddp"), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (pool, summary), (reference_pool, reference) = load_run(tmp_path / "ddp"), load_run(reference_run)
    assert summary["tried"] == 8
    assert [(r["instance_id"], r["accepted"], r["steps"]) for r in summary["instances"]] == [
        (r["instance_id"], r["accepted"], r["steps"]) for r in reference["instances"]]
    assert len(reference_pool) >= 1  # something was learned, so the pools compare prompts
    assert_same_pools(pool, reference_pool, atol=PROMPT_ATOL[tool_run[0]])
    assert (result.stdout + result.stderr).count("Prompt pool:") == 1


def test_killed_run_resumes_to_the_same_pool(tool_run: tuple[str, Path, Path, str], reference_run: Path,
                                             tmp_path: Path) -> None:
    run_dir = tmp_path / "killed"
    assert_killed_run_resumes_to(reference_run, grounding_args(tool_run, run_dir), run_dir, PROMPT_ATOL[tool_run[0]])
