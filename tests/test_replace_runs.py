"""REPLACE runs through the CLI on a random-weight tiny pipeline (gate margin 0, so that some tokens pass and
the pools compare tokens): chunk size 1 vs 8, two DDP processes (uneven chunk split) vs one, and a run killed
between chunks resumes to the same pool."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_cli_subprocess, run_fit
from grounding_helpers import assert_same_runs_at_chunk_sizes_1_and_8
from replace_helpers import fit_args, masked_root
from test_prompt_tuning import assert_killed_run_resumes_to, assert_same_pools, load_run


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return masked_root(tmp_path_factory.mktemp("masked-runs"), ["orange_circle"], images=10)


@pytest.fixture(scope="module")
def reference_run(tiny_sd_dir: Path, data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("reference")
    assert run_fit(*fit_args(tiny_sd_dir, data_root, run_dir)) == 0
    pool, summary = load_run(run_dir)
    assert summary["tried"] == 8 and 1 <= len(pool) < 8  # the gate decides: some pass, some do not
    return run_dir


def test_runs_do_not_depend_on_chunk_size(tiny_sd_dir: Path, data_root: Path, tmp_path: Path) -> None:
    assert_same_runs_at_chunk_sizes_1_and_8(fit_args(tiny_sd_dir, data_root, tmp_path), tmp_path, instances=8)


def test_ddp_two_ranks_match_one_device(tiny_sd_dir: Path, data_root: Path, reference_run: Path, tmp_path: Path) -> None:
    result = run_cli_subprocess(fit_args(tiny_sd_dir, data_root, tmp_path / "ddp", "--trainer.devices=2",
                                         "--trainer.strategy=ddp"), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (pool, summary), (reference_pool, reference) = load_run(tmp_path / "ddp"), load_run(reference_run)
    assert [(r["instance_id"], r["accepted"], r["steps"]) for r in summary["instances"]] == [
        (r["instance_id"], r["accepted"], r["steps"]) for r in reference["instances"]]
    assert_same_pools(pool, reference_pool, atol=1e-5)
    assert (result.stdout + result.stderr).count("Prompt pool:") == 1


def test_killed_run_resumes_to_the_same_pool(tiny_sd_dir: Path, data_root: Path, reference_run: Path,
                                             tmp_path: Path) -> None:
    run_dir = tmp_path / "killed"
    assert_killed_run_resumes_to(reference_run, fit_args(tiny_sd_dir, data_root, run_dir), run_dir)
