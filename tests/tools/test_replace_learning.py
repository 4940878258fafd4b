"""REPLACE learns on the pretrained tiny pipeline (the quickstart's): a token tuned on orange circles lowers the
held-out loss and flips the gate, where the untuned token and random tokens of the same norms do not (summed over
data seeds, with a margin); tokens tuned on images of other concepts filed as orange circles (the known-bad case) are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from clova_train.core.pool import random_prompts_like
from clova_train.tools.replace.tool import InpaintTextualInversion
from helpers.replace import instances, masked_root, tune

pytestmark = [pytest.mark.slow, pytest.mark.learning]

STEPS = 150  # Adam 5e-3 (the paper's learning rate)


@pytest.fixture(scope="module")
def tool(pretrained_sd_dir: Path) -> InpaintTextualInversion:
    return InpaintTextualInversion(str(pretrained_sd_dir), resolution=16)  # the default gate: 2% margin


CONCEPTS = ["orange_circle", "green_square", "red_triangle", "yellow_triangle"]
DATA_SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def data_roots(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("masked-learning")
    return [masked_root(root / f"seed-{seed}", CONCEPTS, images=12, seed=seed) for seed in DATA_SEEDS]


def _passed(tool: InpaintTextualInversion, ctx: object, tokens: torch.Tensor) -> int:
    with torch.no_grad():
        return sum(result.passed for result in tool.gate(ctx, tokens))


def _held_out_loss(tool: InpaintTextualInversion, ctx: object, tokens: torch.Tensor | None) -> float:
    with torch.no_grad():
        return float(torch.stack([losses.mean() for losses in tool.held_out_losses(ctx, tokens)]).sum())


def test_tuning_lowers_the_held_out_loss_and_flips_the_gate(tool: InpaintTextualInversion,
                                                           data_roots: list[Path]) -> None:
    # 18 tunings: 6 orange circles x 3 data seeds. Measured on pipelines built on AVX-512 kernels (1 and 2 threads)
    # and ATen's portable ones: 8 or 9 of 18 tuned tokens pass (4, 3-4, 1 per seed), no untuned token, random
    # tokens of the tuned norms at most 3 of 18 per draw; the held-out loss falls on every seed and is below the
    # words' on two of three, so both are summed over the seeds.
    words = before = after = 0.0
    learned, untuned_passed, controls = 0, 0, [0, 0, 0]
    for data_root in data_roots:
        items = instances(data_root, "orange_circle", "orange_circle", count=6)
        untuned = tool.initial_prompts(items).float()
        ctx, tuned = tune(tool, items, STEPS)
        words += _held_out_loss(tool, ctx, None)
        before += _held_out_loss(tool, ctx, untuned)
        after += _held_out_loss(tool, ctx, tuned)
        untuned_passed += _passed(tool, ctx, untuned)
        learned += _passed(tool, ctx, tuned)
        for seed in range(3):  # control: random tokens of the tuned norms
            controls[seed] += _passed(tool, ctx, random_prompts_like(tuned, torch.Generator().manual_seed(seed)))
    assert after < before and after < words
    assert untuned_passed == 0
    assert learned >= 4, f"{learned} of 18 tuned tokens passed"
    assert max(controls) <= learned / 2, (controls, learned)


@pytest.mark.parametrize("other", ["green_square", "red_triangle", "yellow_triangle"])
def test_tokens_learned_from_another_concept_are_refused(tool: InpaintTextualInversion, data_roots: list[Path],
                                                          other: str) -> None:
    ctx, tuned = tune(tool, instances(data_roots[0], other, "orange_circle", count=3), STEPS)
    assert _passed(tool, ctx, tuned) == 0
