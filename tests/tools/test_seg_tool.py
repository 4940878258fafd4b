"""The MaskFormer SEG prompt tool: contract, mask loss, the gate's rules, serving and runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from clova_train.tools.grounding.instances import GroundingInstance
from clova_train.tools.seg.tool import MaskFormerSeg, mask_iou
from helpers.common import QUIET_CPU_FIT
from helpers.grounding import assert_same_runs_at_chunk_sizes_1_and_8, random_prompt_server


@pytest.fixture(scope="module")
def tool(tiny_maskformer_dir: Path) -> MaskFormerSeg:
    return MaskFormerSeg(str(tiny_maskformer_dir), num_prompt_tokens=4, object_threshold=0.0)


@pytest.fixture(scope="module")
def instances(coco_root: Path) -> list[GroundingInstance]:
    from clova_train.datamodules.prompt_tuning.grounding import GroundingAnnotations, GroundingInstances, GroundingSplit

    annotations = GroundingAnnotations(coco_root / "annotations.json")
    split = GroundingSplit(annotations, "purple circle", max_images=4, num_val_images=2, num_eval_images=0, split_seed=0)
    dataset = GroundingInstances(annotations, split, val_images_per_instance=1)
    return [dataset[i] for i in range(len(dataset))]


def seg_fit_args(maskformer_dir: Path, annotations: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        *QUIET_CPU_FIT,
        f"--trainer.default_root_dir={run_dir}",
        "--model.class_path=clova_train.models.PromptTuning",
        "--model.init_args.tool.class_path=clova_train.tools.seg.tool.MaskFormerSeg",
        f"--model.init_args.tool.init_args.model_name={maskformer_dir}",
        "--model.init_args.tool.init_args.num_prompt_tokens=4",
        "--model.init_args.tool.init_args.object_threshold=0.0",
        "--model.init_args.lr=0.1", "--model.init_args.steps=3",
        "--data.class_path=clova_train.datamodules.GroundingDataModule",
        f"--data.init_args.annotations={annotations}",
        "--data.init_args.concept=purple circle",
        "--data.init_args.num_val_images=2",
        *extra,
    ]


def test_maskformer_passes_check_tool(tool: MaskFormerSeg, instances: list[GroundingInstance]) -> None:
    from clova_train.tools.check import check_tool

    report = check_tool(tool, instances[:3])
    assert report["prompt_shape"] == (4, 32) and report["max_cross_row_gradient"] == 0.0


def test_zero_prompt_and_no_prompt_are_the_unmodified_segmenter(tool: MaskFormerSeg,
                                                                 instances: list[GroundingInstance]) -> None:
    with torch.no_grad():
        ctx = tool.prepare(instances[:2])
        reference = tool.unmodified_outputs(ctx)
        torch.testing.assert_close(tool.prompted_outputs(ctx, None), reference, atol=0, rtol=0)
        zero = tool.prompted_outputs(ctx, torch.zeros(2, *tool.prompt_shape))
        prompted = tool.prompted_outputs(ctx, torch.rand(2, *tool.prompt_shape))
    torch.testing.assert_close(zero, reference, atol=1e-5, rtol=1e-4)
    assert (prompted - reference).abs().max() > 1e-4  # a prompt does change the masks


def test_mask_loss_is_lower_for_the_right_mask_and_ignores_classes(tool: MaskFormerSeg,
                                                                  instances: list[GroundingInstance],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    with torch.no_grad():
        ctx = tool.prepare(instances[:1])
        classes, masks = tool.decode_views(ctx.train, None)
    target = ctx.train.targets[0]
    small = torch.nn.functional.interpolate(target[:, None], size=masks.shape[-2:], mode="bilinear")[:, 0]

    def with_masks(query_masks: torch.Tensor, class_logits: torch.Tensor) -> float:
        monkeypatch.setattr(tool, "decode_views", lambda views, prompts: (class_logits, query_masks))
        return float(tool.instance_losses(ctx, torch.zeros(1, *tool.prompt_shape))[0])

    wrong = torch.full_like(masks, -5.0)
    right = wrong.clone()
    right[0, 3] = small[0] * 10 - 5  # one query draws the concept's object
    assert with_masks(right, classes) < 0.5 * with_masks(wrong, classes)
    assert with_masks(right, classes) == pytest.approx(with_masks(right, torch.randn_like(classes)), abs=1e-6)


def _gate_with(tool: MaskFormerSeg, instances: list[GroundingInstance], monkeypatch: pytest.MonkeyPatch,
               mask_of: str, object_score: float = 0.9) -> list:
    """The gate when one query draws ``mask_of`` ("concept": the concept's objects, "other": another object,
    "shifted": the concept's objects moved by a third of the image) with the given object score."""
    with torch.no_grad():
        ctx = tool.prepare(instances[:1])

    def fake(views, prompts):
        m, q = views.memory.shape[0], tool.model.config.decoder_config.num_queries
        classes = torch.full((m, q, tool.model.config.num_labels + 1), -5.0)
        classes[..., -1] = 5.0  # "no object"
        masks = torch.full((m, q, *views.frame), -8.0)
        for v, item in enumerate(instances[:1] if views is ctx.train else instances[0:1]):
            image = item.train if views is ctx.train else item.val[0]
            others = [i for i, label in enumerate(image.labels) if label != item.concept]
            chosen = image.masks[image.objects_of(item.concept) if mask_of != "other" else others[:1]].any(0)
            if mask_of == "shifted":
                chosen = chosen.roll(shifts=image.size[1] // 3, dims=1)
            masks[v, 0] = chosen.float() * 16 - 8
            classes[v, 0, 0] = torch.log(torch.tensor(object_score / (1 - object_score))) + classes[v, 0, -1]
        return classes, masks

    monkeypatch.setattr(tool, "decode_views", fake)
    monkeypatch.setattr(tool, "object_threshold", 0.5)
    return tool.gate(ctx, torch.zeros(1, *tool.prompt_shape))


def test_gate_passes_the_concepts_mask_and_rejects_others(tool: MaskFormerSeg, instances: list[GroundingInstance],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    assert _gate_with(tool, instances, monkeypatch, "concept")[0].passed
    for wrong in ("other", "shifted"):
        result = _gate_with(tool, instances, monkeypatch, wrong)[0]
        assert not result.passed and result.rejections[0].kind == "low mask IoU"
    # the right mask on a query the model calls "no object" is not a segment a user gets: rejected
    hidden = _gate_with(tool, instances, monkeypatch, "concept", object_score=0.2)[0]
    assert not hidden.passed and "0.00" in hidden.rejections[0].detail


def test_mask_iou_counts_overlap_over_union() -> None:
    a = torch.zeros(1, 4, 4, dtype=torch.bool)
    a[0, :2] = True
    b = torch.zeros(2, 4, 4, dtype=torch.bool)
    b[0, :1], b[1] = True, True
    assert mask_iou(a, b).flatten().tolist() == [0.5, 0.5]
    assert mask_iou(torch.zeros(0, 4, 4, dtype=torch.bool), b).shape == (2, 0)


def test_serving_without_a_pool_entry_is_the_unmodified_segmenter(tool: MaskFormerSeg,
                                                                  instances: list[GroundingInstance]) -> None:
    from clova_train.tools.base import NoPrompt

    server = random_prompt_server(tool, instances)
    image = instances[0].train.image
    plain = tool.segment(NoPrompt(), [image], "orange square")[0]
    served = server.segment([image], "orange square")[0]
    assert served["prompted"] is False and served["scores"] == plain["scores"]
    assert torch.equal(served["masks"], plain["masks"])
    prompted = server.segment([image], "purple circle")[0]
    assert prompted["prompted"] is True
    assert prompted["scores"] != plain["scores"] or not torch.equal(prompted["masks"], plain["masks"])
    assert plain["masks"].shape[1:] == image.shape[1:]


def test_a_serving_request_returns_coco_rle_segments(tool: MaskFormerSeg, instances: list[GroundingInstance],
                                                    coco_root: Path) -> None:
    from pycocotools import mask as mask_utils

    from clova_train.core.errors import DataError
    from clova_train.tools.base import NoPrompt

    image_path = coco_root / "images" / instances[0].train.source.split("(")[-1].rstrip(")")
    reply = tool.serve_request(NoPrompt(), {"image": str(image_path), "concept": "purple circle"})
    plain = tool.segment(NoPrompt(), [instances[0].train.image], "purple circle")[0]
    assert len(reply["segments"]) == len(plain["masks"])
    for segment, mask in zip(reply["segments"], plain["masks"]):
        rle = dict(segment["rle"], counts=segment["rle"]["counts"].encode("ascii"))
        assert (torch.from_numpy(mask_utils.decode(rle)).bool() == mask).all()
        assert segment["area"] == int(mask.sum())
    with pytest.raises(DataError, match="concept"):
        tool.serve_request(NoPrompt(), {"image": str(image_path)})


def test_an_object_with_a_box_but_no_mask_is_refused(tool: MaskFormerSeg, instances: list[GroundingInstance]) -> None:
    import dataclasses

    from clova_train.core.errors import DataError

    image = instances[0].train
    boxes_only = dataclasses.replace(image, masks=torch.zeros_like(image.masks))
    with pytest.raises(DataError, match="no mask"):
        tool.check_instance(dataclasses.replace(instances[0], train=boxes_only))


def test_fit_runs_the_same_at_chunk_size_1_and_8(tiny_maskformer_dir: Path, coco_root: Path, tmp_path: Path) -> None:
    assert_same_runs_at_chunk_sizes_1_and_8(seg_fit_args(tiny_maskformer_dir, coco_root / "annotations.json", tmp_path),
                                            tmp_path, instances=6)


def test_the_demo_picture_outlines_the_segment_that_matches_each_mask(instances: list[GroundingInstance]) -> None:
    from clova_train.tools.grounding.demo import draw, matching_segments

    image = instances[0].train
    concept = instances[0].concept
    target = image.masks[image.objects_of(concept)]
    elsewhere = torch.zeros_like(target[0])
    elsewhere[:2, :2] = True  # a segment that misses every object of the concept
    partial = target[0].clone()
    partial[: partial.shape[0] // 2] = False
    chosen = matching_segments([elsewhere, partial, target[0]], image, concept)
    assert len(chosen) == 1 and torch.equal(chosen[0], target[0])
    assert matching_segments([elsewhere], image, concept) == [] and matching_segments([], image, concept) == []
    picture = draw(image, concept, [({"masks": [target[0]]}, (40, 220, 60))], scale=2)
    assert picture.size == (image.size[1] * 2, image.size[0] * 2)
