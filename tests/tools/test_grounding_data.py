"""Grounding data (COCO / LVIS through pycocotools): the synthetic writer, the split, and bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from clova_train.core.errors import DataError
from clova_train.datamodules.prompt_tuning.grounding import GroundingAnnotations, GroundingInstances, GroundingSplit
from helpers.common import run_fit
from helpers.grounding import loc_fit_args


def test_synthetic_coco_goes_through_pycocotools_with_its_boxes_and_masks(coco_root: Path) -> None:
    annotations = GroundingAnnotations(coco_root / "annotations.json")
    data = json.loads((coco_root / "annotations.json").read_text())
    kinds = {type(a["segmentation"]).__name__ for a in data["annotations"]}
    assert kinds == {"list", "dict"}  # polygons and RLE both occur
    for image_id in annotations.images_of(annotations.category_id("purple circle")):
        image = annotations.grounded_image(image_id)
        assert image.image.dtype == torch.uint8 and image.size == (64, 64)
        assert "purple circle" in image.labels and "purple circle" not in image.absent
        assert set(image.absent).isdisjoint(image.labels)
        for box, mask in zip(image.boxes, image.masks):
            ys, xs = torch.nonzero(mask, as_tuple=True)
            assert mask.any()
            # the mask lies inside its box (to a rasterisation pixel)
            assert xs.min() >= box[0] - 1 and xs.max() <= box[2] and ys.min() >= box[1] - 1 and ys.max() <= box[3]


def test_split_is_seeded_and_disjoint(coco_root: Path) -> None:
    annotations = GroundingAnnotations(coco_root / "annotations.json")
    a = GroundingSplit(annotations, "purple circle", max_images=4, num_val_images=2, num_eval_images=1, split_seed=3)
    b = GroundingSplit(annotations, "purple circle", max_images=4, num_val_images=2, num_eval_images=1, split_seed=3)
    c = GroundingSplit(annotations, "purple circle", max_images=4, num_val_images=2, num_eval_images=1, split_seed=4)
    assert (a.train_ids, a.val_ids, a.eval_ids) == (b.train_ids, b.val_ids, b.eval_ids)
    assert (a.train_ids, a.val_ids) != (c.train_ids, c.val_ids)
    assert len(a.train_ids) == 4 and len(a.val_ids) == 2 and len(a.eval_ids) == 1
    assert not set(a.train_ids) & set(a.val_ids) and not set(a.train_ids) & set(a.eval_ids)
    assert not set(a.val_ids) & set(a.eval_ids)
    instances = GroundingInstances(annotations, a, val_images_per_instance=2)
    val_sources = {image.source for image in instances.val_images}
    for i in range(len(instances)):
        item = instances[i]
        assert item.concept == "purple circle" and len(item.val) == 2
        assert item.train.source not in val_sources  # a gate image is never trained on
    # by id as well as by name
    assert GroundingSplit(annotations, str(a.category_id), 4, 2, 1, 3).train_ids == a.train_ids


def test_lvis_files_use_coco_urls_and_verified_negatives(coco_root: Path, tmp_path: Path) -> None:
    data = json.loads((coco_root / "annotations.json").read_text())
    names = {c["id"]: c["name"] for c in data["categories"]}
    purple = next(k for k, v in names.items() if v == "purple circle")
    for image in data["images"]:
        image["coco_url"] = f"http://images.cocodataset.org/train2017/{image.pop('file_name')}"
        present = {a["category_id"] for a in data["annotations"] if a["image_id"] == image["id"]}
        image["neg_category_ids"] = [k for k in sorted(names) if k not in present][:3]
        image["not_exhaustive_category_ids"] = []
    lvis = tmp_path / "lvis.json"
    lvis.write_text(json.dumps(data))
    annotations = GroundingAnnotations(lvis, coco_root / "images")
    assert annotations.lvis
    image = annotations.grounded_image(annotations.images_of(purple)[0])
    assert len(image.absent) == 3  # only the verified negatives, not every unannotated category


def test_queries_are_the_concept_another_present_class_and_absent_negatives(coco_root: Path) -> None:
    from clova_train.tools.grounding.instances import instance_rng, queries_for

    annotations = GroundingAnnotations(coco_root / "annotations.json")
    image = annotations.grounded_image(annotations.images_of(annotations.category_id("purple circle"))[0])
    names, positives = queries_for(image, "purple circle", 13, instance_rng("x", "train"))
    assert names[0] == "purple circle" and positives == 2 and names[1] in image.labels
    assert len(names) == 15 and len(set(names)) == 15
    assert set(names[2:]) <= set(image.absent)
    assert queries_for(image, "purple circle", 13, instance_rng("x", "train")) == (names, positives)


# ---------------------------------------------------------------------- bad input
def _break(data: dict, case: str) -> str | None:
    """Make ``data`` bad in the way ``case`` says; returns the text to write instead, if not JSON."""
    purple_image = next(a["image_id"] for a in data["annotations"] if a["category_id"] == 13)
    annotation = next(a for a in data["annotations"] if a["image_id"] == purple_image)
    if case == "malformed_json":
        return json.dumps(data)[:-20]
    if case == "box_outside":
        annotation["bbox"] = [50.0, 10.0, 30.0, 10.0]
    elif case == "non_positive_size":
        annotation["bbox"] = [10.0, 10.0, 0.0, 5.0]
    elif case == "polygon_outside":
        annotation["segmentation"] = [[1.0, 1.0, 90.0, 1.0, 90.0, 20.0]]
    elif case == "rle_size":
        from pycocotools import mask as mask_utils

        rle = mask_utils.encode(np.asfortranarray(np.ones((32, 64), dtype=np.uint8)))
        annotation["segmentation"] = {"size": [32, 64], "counts": rle["counts"].decode()}
    elif case == "missing_image":
        next(i for i in data["images"] if i["id"] == purple_image)["file_name"] = "nowhere.png"
    elif case == "unknown_concept":
        for category in data["categories"]:
            if category["name"] == "purple circle":
                category["name"] = "violet disc"
    return None


BAD_CASES = {
    "malformed_json": "not valid JSON",
    "box_outside": "lies outside the 64x64 image",
    "non_positive_size": "has a non-positive size",
    "polygon_outside": "polygon lies outside the 64x64 image",
    "rle_size": "RLE size [32, 64] does not match the image's [height, width] [64, 64]",
    "missing_image": "image file not found",
    "unknown_concept": "category 'purple circle' selects nothing",
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_annotations_fail_with_one_message_and_no_pool(case: str, coco_root: Path, tiny_owlvit_dir: Path,
                                                           tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data = json.loads((coco_root / "annotations.json").read_text())
    assert next(c["id"] for c in data["categories"] if c["name"] == "purple circle") == 13
    text = _break(data, case)
    bad = tmp_path / "annotations.json"
    bad.write_text(text if text is not None else json.dumps(data))
    shutil.copytree(coco_root / "images", tmp_path / "images")
    run_dir = tmp_path / "run"
    assert run_fit(*loc_fit_args(tiny_owlvit_dir, bad, run_dir)) == 2
    err = capsys.readouterr().err
    assert "clova-train: error:" in err and BAD_CASES[case] in err and "Traceback" not in err
    assert "annotations.json" in err
    if case not in ("malformed_json", "unknown_concept", "missing_image"):
        assert "annotation " in err  # names the record
    assert not (run_dir / "pool.safetensors").exists()


@pytest.mark.parametrize("image_id", [999, None, [1]])
def test_an_annotation_of_no_image_names_the_file_and_the_annotation(coco_root: Path, tmp_path: Path,
                                                                     image_id: object) -> None:
    data = json.loads((coco_root / "annotations.json").read_text())
    data["annotations"][2]["image_id"] = image_id
    bad = tmp_path / "annotations.json"
    bad.write_text(json.dumps(data))
    annotation_id = data["annotations"][2]["id"]
    with pytest.raises(DataError, match=rf"annotations.json: annotations\[2\] \(id {annotation_id}\) has image_id "
                                        r".*, which names no image of the file"):
        GroundingAnnotations(bad)


def test_too_few_images_for_the_split_is_an_error(coco_root: Path) -> None:
    annotations = GroundingAnnotations(coco_root / "annotations.json")
    with pytest.raises(DataError, match="none left for training"):
        GroundingSplit(annotations, "purple circle", 4, num_val_images=8, num_eval_images=0, split_seed=0)


def test_best_box_iou_scores_each_target_against_its_best_prediction() -> None:
    from clova_train.tools.grounding.instances import best_box_iou

    targets = torch.tensor([[0.0, 0.0, 10.0, 10.0], [20.0, 20.0, 30.0, 30.0]])
    predicted = torch.tensor([[0.0, 0.0, 10.0, 5.0], [20.0, 20.0, 30.0, 30.0], [100.0, 100.0, 110.0, 110.0]])
    assert best_box_iou(predicted, targets).tolist() == pytest.approx([0.5, 1.0])
    assert best_box_iou(torch.zeros(0, 4), targets).tolist() == [0.0, 0.0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the batch's boxes on it, the predictions not")
def test_best_box_iou_takes_targets_from_a_batch_on_the_gpu() -> None:
    # the GPU check found LOC's validation failing here: Lightning moves the batch's boxes to the GPU while the
    # detections come back as lists of floats
    from clova_train.tools.grounding.instances import best_box_iou

    targets = torch.tensor([[0.0, 0.0, 10.0, 10.0]], device="cuda")
    assert best_box_iou(torch.tensor([[0.0, 0.0, 10.0, 5.0]]), targets).tolist() == pytest.approx([0.5])
