"""SEG learns on a pretrained tiny MaskFormer: tuning lowers the mask loss and flips the gate on a learnable case
(summed over scene sets and prompt seeds, with a margin), the gate refuses prompts that fit only their own image (a
colour the segmenter learned to leave in the background), and an exported pool changes the served masks in a fresh
process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from clova_train.tools.seg.tool import MaskFormerSeg
from helpers.grounding import instances_of, outcomes, scene_sets, serve_accepted_in_fresh_process, tune

pytestmark = [pytest.mark.slow, pytest.mark.learning]


@pytest.fixture(scope="module")
def tool(pretrained_maskformer_dir: Path) -> MaskFormerSeg:
    return MaskFormerSeg(str(pretrained_maskformer_dir), num_prompt_tokens=16, object_threshold=0.0)


@pytest.fixture(scope="module")
def two_scene_sets(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return scene_sets(tmp_path_factory.mktemp("seg-scene-sets"), ["purple circle", "red circle"])


def test_tuning_lowers_the_mask_loss_and_flips_the_gate_where_the_segmenter_fails(
        tool: MaskFormerSeg, two_scene_sets: list[Path]) -> None:
    # 48 tunings: 8 red circles x 2 scene sets x 3 prompt seeds. Measured on segmenters built on the host's and on
    # ATen's portable kernels, at 1 and 2 threads: the mean loss falls by 18 to 58%, tuned prompts pass the gate
    # 27 to 45 times where the unprompted segmenter passes 9 to 18. Random prompts of the tuned norms pass as often
    # (21 to 48): the gate's masks respond to any prompt of that size, so SEG's pool is not shown to beat a random
    # one (docs/tools/loc-seg.md: a negative result), and that comparison is not asserted.
    result = outcomes(tool, two_scene_sets, "red circle")
    assert result.last_loss < 0.9 * result.first_loss
    assert result.loss_fell > result.tunings / 2
    assert result.after >= result.before + 12, result


def test_the_gate_rejects_prompts_that_fit_only_their_own_image(tool: MaskFormerSeg, two_scene_sets: list[Path]) -> None:
    # the segmenter learned to leave purple shapes in the background: a mask-only prompt fits its training
    # image a little better, but cannot make the frozen pixel decoder separate purple on held-out images
    for scenes in two_scene_sets:
        ctx, first, last, prompts = tune(tool, instances_of(scenes, "purple circle"))
        assert (last < first).all()
        with torch.no_grad():
            results = tool.gate(ctx, prompts)
        assert not any(result.passed for result in results)
        assert all(r.kind == "low mask IoU" for result in results for r in result.rejections)


def test_an_exported_pool_changes_the_masks_in_a_fresh_process_without_lightning(
        tool: MaskFormerSeg, two_scene_sets: list[Path], tmp_path: Path) -> None:
    scenes = two_scene_sets[0]
    served, plain = serve_accepted_in_fresh_process(tool, instances_of(scenes, "red circle"), scenes,
                                                    tmp_path / "export")
    assert served["prompted"] is True and plain["prompted"] is False
    assert served["segments"] != plain["segments"]
