"""REPLACE learns on the pretrained tiny pipeline (the quickstart's): a token tuned on orange circles lowers the
held-out loss and flips the gate, where the untuned token and random tokens of the same norms do not; tokens
tuned on images of other concepts filed as orange circles (the known-bad case) are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from clova_train.core.pool import random_prompts_like
from clova_train.tools.sd_inpaint_replace import InpaintTextualInversion
from helpers.replace import instances, masked_root, tune

pytestmark = pytest.mark.slow

STEPS = 150  # Adam 5e-3 (the paper's learning rate)


@pytest.fixture(scope="module")
def tool(pretrained_sd_dir: Path) -> InpaintTextualInversion:
    return InpaintTextualInversion(str(pretrained_sd_dir), resolution=16)  # the default gate: 2% margin


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return masked_root(tmp_path_factory.mktemp("masked-learning"),
                       ["orange_circle", "green_square", "red_triangle", "yellow_triangle"], images=12)


def _passed(tool: InpaintTextualInversion, ctx: object, tokens: torch.Tensor) -> int:
    with torch.no_grad():
        return sum(result.passed for result in tool.gate(ctx, tokens))


def test_tuning_lowers_the_held_out_loss_and_flips_the_gate(tool: InpaintTextualInversion, data_root: Path) -> None:
    items = instances(data_root, "orange_circle", "orange_circle", count=6)
    untuned = tool.initial_prompts(items).float()
    ctx, tuned = tune(tool, items, STEPS)
    with torch.no_grad():
        words = torch.stack([losses.mean() for losses in tool.held_out_losses(ctx, None)])
        before = torch.stack([losses.mean() for losses in tool.held_out_losses(ctx, untuned)])
        after = torch.stack([losses.mean() for losses in tool.held_out_losses(ctx, tuned)])
    assert float(after.mean()) < float(before.mean()) and float(after.mean()) < float(words.mean())
    assert _passed(tool, ctx, untuned) == 0
    learned = _passed(tool, ctx, tuned)
    assert learned >= 2, f"{learned} of 6 tuned tokens passed"
    for seed in range(3):  # control: random tokens of the tuned norms
        assert _passed(tool, ctx, random_prompts_like(tuned, torch.Generator().manual_seed(seed))) < learned


@pytest.mark.parametrize("other", ["green_square", "red_triangle", "yellow_triangle"])
def test_tokens_learned_from_another_concept_are_refused(tool: InpaintTextualInversion, data_root: Path,
                                                          other: str) -> None:
    ctx, tuned = tune(tool, instances(data_root, other, "orange_circle", count=3), STEPS)
    assert _passed(tool, ctx, tuned) == 0
