"""The OWL-ViT LOC prompt tool: contract, OWL-ViT losses, the gate's rules, serving and runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from clova_train.tools.grounding.instances import GroundingInstance
from clova_train.tools.loc.tool import OwlVitLoc
from helpers.grounding import assert_same_runs_at_chunk_sizes_1_and_8, loc_fit_args, random_prompt_server


@pytest.fixture(scope="module")
def tool(tiny_owlvit_dir: Path) -> OwlVitLoc:
    return OwlVitLoc(str(tiny_owlvit_dir), num_prompt_tokens=4)


@pytest.fixture(scope="module")
def instances(coco_root: Path) -> list[GroundingInstance]:
    from clova_train.datamodules.prompt_tuning.grounding import GroundingAnnotations, GroundingInstances, GroundingSplit

    annotations = GroundingAnnotations(coco_root / "annotations.json")
    split = GroundingSplit(annotations, "purple circle", max_images=4, num_val_images=2, num_eval_images=0, split_seed=0)
    dataset = GroundingInstances(annotations, split, val_images_per_instance=1)
    return [dataset[i] for i in range(len(dataset))]


def test_owlvit_passes_check_tool(tool: OwlVitLoc, instances: list[GroundingInstance]) -> None:
    from clova_train.tools.check import check_tool

    report = check_tool(tool, instances[:3])
    assert report["prompt_shape"] == (4, 64) and report["max_cross_row_gradient"] == 0.0


def test_zero_prompt_and_no_prompt_are_the_unmodified_detector(tool: OwlVitLoc, instances: list[GroundingInstance]) -> None:
    with torch.no_grad():
        ctx = tool.prepare(instances[:2])
        reference = tool.unmodified_outputs(ctx)
        zero = tool.prompted_outputs(ctx, torch.zeros(2, *tool.prompt_shape))
        prompted = tool.prompted_outputs(ctx, torch.rand(2, *tool.prompt_shape))
    torch.testing.assert_close(zero, reference, atol=1e-5, rtol=1e-4)
    assert (prompted - reference).abs().max() > 1e-4  # a prompt does change the detections


def test_hungarian_matching_pairs_each_box_with_the_nearest_prediction() -> None:
    from clova_train.tools.loc.detection_losses import BoxTargets, detection_losses, hungarian_match

    boxes = torch.tensor([[0.2, 0.2, 0.1, 0.1], [0.7, 0.7, 0.2, 0.2], [0.5, 0.5, 0.3, 0.3]])
    logits = torch.full((3, 2), -4.0)
    target = BoxTargets(torch.tensor([1, 0]), torch.tensor([[0.71, 0.69, 0.2, 0.2], [0.2, 0.21, 0.1, 0.1]]))
    rows, cols = hungarian_match(logits, boxes, target)
    assert dict(zip(rows.tolist(), cols.tolist())) == {0: 1, 1: 0}
    # a perfect prediction has a lower loss than the same boxes with the wrong query
    good = logits.clone()
    good[0, 0], good[1, 1] = 4.0, 4.0
    bad = logits.clone()
    bad[0, 1], bad[1, 0] = 4.0, 4.0
    mask = torch.ones(1, 2, dtype=torch.bool)
    losses = detection_losses(torch.stack([good, bad]), torch.stack([boxes, boxes]), mask.repeat(2, 1), [target, target])
    assert losses[0] < losses[1]


def _gate_with(tool: OwlVitLoc, instances: list[GroundingInstance], monkeypatch: pytest.MonkeyPatch,
               score: float, box_shift: float, winner: int = 0) -> list:
    """The gate on detector outputs we choose: the concept's query scores ``score`` on patches at its true
    boxes (moved by ``box_shift`` of the image), and ``winner`` is the best query there."""
    from torchvision.ops import box_convert

    with torch.no_grad():
        ctx = tool.prepare(instances[:1])

    def fake(embedded, prompts, queries, query_mask):
        views = ctx.train if embedded is ctx.train.embedded else ctx.val
        m, patches, q = embedded.shape[0], embedded.shape[1] - 1, queries.shape[1]
        logits = torch.full((m, patches, q), -8.0)
        boxes = torch.full((m, patches, 4), 0.05)
        for v in range(m):
            height, width = views.sizes[v]
            scale = torch.tensor([width, height, width, height])
            for k, (label, box) in enumerate(zip(views.targets[v].labels, views.boxes[v])):
                moved = box / scale + box_shift
                boxes[v, k] = box_convert(moved[None], "xyxy", "cxcywh")[0]
                if label != 0:
                    logits[v, k, label] = 3.0  # the other positive: found
                    continue
                logits[v, k, 0] = torch.logit(torch.tensor(score))
                if winner:
                    logits[v, k, winner] = logits[v, k, 0] + 1
        return logits, boxes

    monkeypatch.setattr(tool, "detect_tokens", fake)
    return tool.gate(ctx, torch.zeros(1, *tool.prompt_shape))


def test_gate_passes_good_boxes_and_rejects_wrong_ones(tool: OwlVitLoc, instances: list[GroundingInstance],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    assert _gate_with(tool, instances, monkeypatch, score=0.5, box_shift=0.0)[0].passed
    low_iou = _gate_with(tool, instances, monkeypatch, score=0.5, box_shift=0.3)[0]
    assert not low_iou.passed and low_iou.rejections[0].kind == "low IoU"
    weak = _gate_with(tool, instances, monkeypatch, score=0.05, box_shift=0.0)[0]
    assert not weak.passed and weak.rejections[0].kind == "not detected"
    # the box is found, but another query (a negative) scores higher there: not the concept's detection
    confused = _gate_with(tool, instances, monkeypatch, score=0.5, box_shift=0.0, winner=3)[0]
    assert not confused.passed and confused.rejections[0].kind == "not detected"
    assert "purple circle" in confused.rejections[0].detail


def test_serving_with_no_pool_entry_is_the_unmodified_detector(tool: OwlVitLoc, instances: list[GroundingInstance]) -> None:
    from clova_train.tools.base import NoPrompt

    server = random_prompt_server(tool, instances)
    image = instances[0].train.image
    plain = tool.detect(NoPrompt(), [image], "orange square")
    assert server.detect([image], "orange square") == plain  # no prompts for this concept
    assert plain[0]["prompted"] is False
    for box in plain[0]["boxes"]:
        assert 0 <= box[0] <= box[2] <= 64 and 0 <= box[1] <= box[3] <= 64


@pytest.mark.slow
def test_fit_runs_the_same_at_chunk_size_1_and_8(tiny_owlvit_dir: Path, coco_root: Path, tmp_path: Path) -> None:
    assert_same_runs_at_chunk_sizes_1_and_8(loc_fit_args(tiny_owlvit_dir, coco_root / "annotations.json", tmp_path),
                                            tmp_path, instances=6)


def test_serving_keeps_only_candidates_under_which_the_concept_is_detected(
        tool: OwlVitLoc, instances: list[GroundingInstance], monkeypatch: pytest.MonkeyPatch) -> None:
    from clova_train.tools.base import NoPrompt

    server = random_prompt_server(tool, instances)
    image = instances[0].train.image
    monkeypatch.setattr(tool, "score_threshold", 0.999)  # no candidate detects the concept: none is used
    assert server.detect([image], "purple circle") == tool.detect(NoPrompt(), [image], "purple circle")
    monkeypatch.setattr(tool, "score_threshold", 1e-6)  # every candidate does: their ensemble is used
    served = server.detect([image], "purple circle")[0]
    assert served["prompted"] is True
    assert served != tool.detect(NoPrompt(), [image], "purple circle")[0]
