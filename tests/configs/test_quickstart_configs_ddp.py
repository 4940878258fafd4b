"""The quickstart configs on several CPU ranks as users run them (issue 37): each with its own progress bar,
loggers and callbacks on two ranks (recipes and checks in helpers/shipped_configs.py); three ranks with callbacks the
configs do not name; and a two-rank run killed inside its epoch, resumed with its bar and loggers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.shipped_configs import (
    RECIPES, assert_batch_counts_announced, assert_loggers_wrote, assert_ran_cleanly, callback_arg,
    check_shipped_config, launch, lightning_configs,
)


def test_every_lightning_config_has_a_multi_device_recipe() -> None:
    assert sorted(RECIPES) == lightning_configs()


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(c for c in RECIPES if c.startswith("quickstart/")))
def test_quickstart_config_runs_on_two_devices_with_its_own_bar_and_loggers(
    config: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    check_shipped_config(config, request, tmp_path)


# Three ranks and callbacks the shipped configs do not name: the tqdm bar instead of rich, callbacks that read
# logged metrics on every rank (EarlyStopping conditioned on a training metric raises on a rank that lacks it),
# the learning-rate monitor, a timer and the rich model summary; each split uneven over the three ranks.
OTHER_CALLBACKS = [
    callback_arg("lightning.pytorch.callbacks.TQDMProgressBar", refresh_rate=1),
    callback_arg("lightning.pytorch.callbacks.LearningRateMonitor", logging_interval="step"),
    # interval given: jsonargparse cannot represent Timer's default (an enum member), a LightningCLI limitation
    callback_arg("lightning.pytorch.callbacks.Timer", duration="00:00:30:00", interval="step"),
    callback_arg("lightning.pytorch.callbacks.RichModelSummary", max_depth=2),
]
THREE_RANKS = ["--trainer.accelerator=cpu", "--trainer.devices=3", "--trainer.strategy=ddp"]
OTHER_SETS = {
    "quickstart/clip_prompt.yaml": [  # 10 instances in 4 chunks of 3: two per rank, ranks 1 and 2 pad
        "--data.init_args.chunk_size=3",
        callback_arg("lightning.pytorch.callbacks.EarlyStopping", monitor="loss", patience=100, check_on_train_epoch_end=True)],
    "quickstart/tool_llm_lora.yaml": [  # 111 samples in batches of 5 on 3 ranks: the last global batch holds 6
        callback_arg("lightning.pytorch.callbacks.EarlyStopping", monitor="train/loss", patience=100,
                     check_on_train_epoch_end=True)],
}


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(OTHER_SETS))
def test_three_ranks_with_other_callbacks(config: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    result, settings = launch(config, request, tmp_path, *OTHER_CALLBACKS, *OTHER_SETS[config],
                              launch_args=THREE_RANKS)
    output = assert_ran_cleanly(result)
    counts = assert_batch_counts_announced(tmp_path, ranks=3)
    assert all(c["has_bar"] for c in counts)
    assert "Epoch 0: 100%" in output  # tqdm drew its bar on rank 0, up to the announced total
    assert_loggers_wrote(tmp_path, settings)
    metrics = next(tmp_path.rglob("metrics.csv")).read_text().splitlines()[0].split(",")
    assert any(name.startswith("lr-") for name in metrics), metrics  # LearningRateMonitor logged on rank 0
    if "chunk_size" in " ".join(OTHER_SETS[config]):
        summary = json.loads((tmp_path / settings["trainer"]["default_root_dir"] / "summary.json").read_text())
        assert summary["complete"] and summary["tried"] == 10
        assert counts[0]["epochs"][0]["announced"] == 2


@pytest.mark.slow
def test_a_killed_two_rank_run_resumes_with_its_bar_and_loggers(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Both ranks die at the start of the second chunk; the resumed run announces the chunks its checkpoint counts
    plus those pending (Lightning counts the restored ones as done) and runs exactly those."""
    config = "quickstart/clip_prompt.yaml"  # 10 instances in 3 chunks of 4: two steps per rank
    killed, settings = launch(config, request, tmp_path, callback_arg("helpers.kill.KillAtChunk", chunk=1))
    assert killed.returncode == -9, (killed.stdout + killed.stderr)[-4000:]
    run_dir = tmp_path / settings["trainer"]["default_root_dir"]
    assert not (run_dir / "summary.json").exists()
    resumed, _ = launch(config, request, tmp_path, f"--ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}")
    assert_ran_cleanly(resumed)
    counts = assert_batch_counts_announced(tmp_path)
    assert counts[0]["epochs"] == [{"announced": 2, "ran": 2, "resumed_at": 1}]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["complete"] and summary["tried"] == 10
