"""SEG learns on a pretrained tiny MaskFormer: tuning lowers the mask loss and flips the gate on a learnable
case, the gate refuses prompts that fit only their own image (a colour the segmenter learned to leave in the
background), and an exported pool changes the served masks in a fresh process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from clova_train.tools.maskformer_seg import MaskFormerSeg
from helpers.grounding import instances_of, random_control, serve_accepted_in_fresh_process, tune

pytestmark = pytest.mark.slow





@pytest.fixture(scope="module")
def tool(pretrained_maskformer_dir: Path) -> MaskFormerSeg:
    return MaskFormerSeg(str(pretrained_maskformer_dir), num_prompt_tokens=16, object_threshold=0.0)


def test_tuning_lowers_the_mask_loss_and_flips_the_gate_where_the_segmenter_fails(tool: MaskFormerSeg,
                                                                                 seg_scenes: Path) -> None:
    instances = instances_of(seg_scenes, "red circle")
    ctx, first, last, prompts = tune(tool, instances)
    with torch.no_grad():
        before = [r.passed for r in tool.gate(ctx, torch.zeros_like(prompts))]
        after = [r.passed for r in tool.gate(ctx, prompts)]
        control = [r.passed for r in tool.gate(ctx, random_control(prompts))]
    assert (last < first).all()
    assert not all(before)  # the unprompted segmenter misses some of these objects
    flipped = sum(a and not b for a, b in zip(after, before))
    assert flipped >= 2  # tuned prompts fix some of those...
    assert sum(after) > max(sum(before), sum(control))  # ...which random prompts of their norms do not


def test_the_gate_rejects_prompts_that_fit_only_their_own_image(tool: MaskFormerSeg, seg_scenes: Path) -> None:
    # the segmenter learned to leave purple shapes in the background: a mask-only prompt fits its training
    # image a little better, but cannot make the frozen pixel decoder separate purple on held-out images
    instances = instances_of(seg_scenes, "purple circle")
    ctx, first, last, prompts = tune(tool, instances)
    assert (last < first).all()
    with torch.no_grad():
        results = tool.gate(ctx, prompts)
    assert not any(result.passed for result in results)
    assert all(r.kind == "low mask IoU" for result in results for r in result.rejections)


def test_an_exported_pool_changes_the_masks_in_a_fresh_process_without_lightning(
        tool: MaskFormerSeg, seg_scenes: Path, tmp_path: Path) -> None:
    served, plain = serve_accepted_in_fresh_process(tool, instances_of(seg_scenes, "red circle"), seg_scenes,
                                                    tmp_path / "export")
    assert served["prompted"] is True and plain["prompted"] is False
    assert served["segments"] != plain["segments"]
