"""Reading open-vocabulary grounding data (COCO / LVIS annotation files): annotations, the split, instances.

No Lightning here: the grounding datamodule (``clova_train.datamodules.grounding``) and serving demos share it.

The annotation file is read with pycocotools (``COCO``): images, annotations with ``bbox`` (``[x, y, w, h]``
pixels) and ``segmentation`` (polygons or RLE), categories. LVIS files are the same format plus, per image,
``neg_category_ids`` (verified absent) and ``not_exhaustive_category_ids``; an image's query negatives are
its ``neg_category_ids`` in LVIS, and every category it has no annotation of in COCO (exhaustive labels).
Images without ``file_name`` (LVIS) are found by the last part of their ``coco_url``.

One concept (a category name or id) is selected. Its images are shuffled with ``split_seed`` and split, in
this order, into ``num_eval_images`` for ``validate`` / ``test``, ``num_val_images`` for the gate, and up to
``max_images`` training images (paper: 200 for LOC, 50 for SEG); an image is in one split only, so
validation images are never trained on. Each training image is one instance; it is gated on
``val_images_per_instance`` of the gate's images (assigned round-robin).

Everything used is checked when the datamodule is set up, before anything is trained: malformed JSON, a
box outside its image or of non-positive size, a polygon outside its image or an RLE whose size is not the
image's, a missing or unreadable image file, an image whose pixels are not the size the file says, and a
concept that selects nothing each stop the run with one message naming the file and the record.
"""

from __future__ import annotations

import contextlib
import io
import json
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clova_train.core.errors import DataError
from clova_train.tools.grounding import GroundedImage, GroundingInstance
from clova_train.tools.images import load_image_uint8

EDGE_TOLERANCE = 1.0  # pixels: annotation tools round box and polygon edges


class GroundingAnnotations:
    """A COCO or LVIS annotation file, indexed by pycocotools, with checked access to its images.

    Args:
        path: the annotation JSON.
        image_root: folder of the image files (default: ``images/`` next to the file if it exists, else its folder).
    """

    def __init__(self, path: str | Path, image_root: str | Path | None = None) -> None:
        from pycocotools.coco import COCO

        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"annotation file not found: {self.path}")
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise DataError(f"{self.path}: not valid JSON: {err}") from err
        if not isinstance(data, dict):
            raise DataError(f"{self.path}: a COCO annotation file is a JSON object, got {type(data).__name__}")
        for key in ("images", "annotations", "categories"):
            if not isinstance(data.get(key), list):
                raise DataError(f"{self.path}: missing list {key!r} (a COCO / LVIS annotation file has images, "
                                "annotations and categories)")
        self._check_records(data)
        self.coco = COCO()
        self.coco.dataset = data
        with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress
            self.coco.createIndex()
        self.lvis = any("neg_category_ids" in image for image in data["images"])
        if image_root is not None:
            self.image_root = Path(image_root)
        else:
            beside = self.path.parent / "images"
            self.image_root = beside if beside.is_dir() else self.path.parent

    def _check_records(self, data: dict) -> None:
        for kind, required in (("images", ("id", "height", "width")), ("categories", ("id", "name")),
                               ("annotations", ("id", "image_id", "category_id", "bbox"))):
            for number, record in enumerate(data[kind]):
                if not isinstance(record, dict) or any(key not in record for key in required):
                    raise DataError(f"{self.path}: {kind}[{number}] needs {', '.join(required)}; got {record!r:.200}")
        ids = [image["id"] for image in data["images"]]
        if len(set(ids)) != len(ids):
            raise DataError(f"{self.path}: image ids are not unique")

    # ------------------------------------------------------------------ categories
    @cached_property
    def category_names(self) -> dict[int, str]:
        return {int(c["id"]): str(c["name"]) for c in self.coco.dataset["categories"]}

    def category_id(self, concept: str | int) -> int:
        """The id of ``concept`` (a name, or an id), which must have at least one annotation."""
        if isinstance(concept, int) or (isinstance(concept, str) and concept.isdigit()):
            found = int(concept) if int(concept) in self.category_names else None
        else:
            matches = [cid for cid, name in self.category_names.items() if name == concept]
            found = matches[0] if matches else None
        if found is None or not self.coco.getAnnIds(catIds=[found]):
            names = sorted(self.category_names.values())
            shown = ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")
            raise DataError(f"{self.path}: category {concept!r} selects nothing"
                            f"{' (no annotations)' if found is not None else ''}; categories: {shown}")
        return found

    def images_of(self, category_id: int) -> list[int]:
        return sorted(self.coco.getImgIds(catIds=[category_id]))

    # ------------------------------------------------------------------ images
    def image_file(self, image_id: int) -> Path:
        info = self.coco.imgs[image_id]
        name = info.get("file_name") or str(info.get("coco_url", "")).rsplit("/", 1)[-1]
        if not name:
            raise DataError(f"{self.path}: image {image_id} has neither file_name nor coco_url")
        return self.image_root / name

    def where(self, image_id: int, annotation_id: Any = None) -> str:
        place = f"{self.path.name}: image {image_id} ({self.coco.imgs[image_id].get('file_name', '')})"
        return place if annotation_id is None else f"{place}, annotation {annotation_id}"

    def _check_annotation(self, image_id: int, annotation: dict, height: int, width: int) -> None:
        where = self.where(image_id, annotation.get("id"))
        box = annotation["bbox"]
        if not (isinstance(box, list) and len(box) == 4 and all(isinstance(v, (int, float)) for v in box)):
            raise DataError(f"{where}: bbox must be [x, y, width, height], got {box!r}")
        x, y, w, h = box
        if w <= 0 or h <= 0:
            raise DataError(f"{where}: bbox {box} has a non-positive size")
        if x < -EDGE_TOLERANCE or y < -EDGE_TOLERANCE or x + w > width + EDGE_TOLERANCE or y + h > height + EDGE_TOLERANCE:
            raise DataError(f"{where}: bbox {box} lies outside the {width}x{height} image")
        if annotation.get("category_id") not in self.category_names:
            raise DataError(f"{where}: unknown category_id {annotation.get('category_id')!r}")
        segmentation = annotation.get("segmentation")
        if segmentation is None or segmentation == []:
            return
        if isinstance(segmentation, dict):
            size = segmentation.get("size")
            if list(size or []) != [height, width]:
                raise DataError(f"{where}: RLE size {size} does not match the image's [height, width] "
                                f"[{height}, {width}]")
            if not isinstance(segmentation.get("counts"), (str, list)):
                raise DataError(f"{where}: RLE without counts")
        elif isinstance(segmentation, list):
            for polygon in segmentation:
                if not (isinstance(polygon, list) and len(polygon) >= 6 and len(polygon) % 2 == 0):
                    raise DataError(f"{where}: a polygon is a list of at least 3 x, y pairs, got {polygon!r:.80}")
                xs, ys = np.asarray(polygon[0::2], dtype=float), np.asarray(polygon[1::2], dtype=float)
                if (xs.min() < -EDGE_TOLERANCE or ys.min() < -EDGE_TOLERANCE or xs.max() > width + EDGE_TOLERANCE
                        or ys.max() > height + EDGE_TOLERANCE):
                    raise DataError(f"{where}: polygon lies outside the {width}x{height} image")
        else:
            raise DataError(f"{where}: segmentation must be polygons or an RLE, got {type(segmentation).__name__}")

    def grounded_image(self, image_id: int) -> GroundedImage:
        """The image with all of its annotated objects (boxes, masks) and its known-absent categories."""
        info = self.coco.imgs[image_id]
        height, width = int(info["height"]), int(info["width"])
        if height < 1 or width < 1:
            raise DataError(f"{self.where(image_id)}: non-positive image size {width}x{height}")
        file = self.image_file(image_id)
        if not file.is_file():
            raise DataError(f"{self.where(image_id)}: image file not found: {file}")
        image = load_image_uint8(file)
        if tuple(image.shape[1:]) != (height, width):
            raise DataError(f"{self.where(image_id)}: {file} is {image.shape[2]}x{image.shape[1]} pixels, the "
                            f"annotation file says {width}x{height}")
        annotations = self.coco.loadAnns(self.coco.getAnnIds(imgIds=[image_id], iscrowd=None))
        labels, boxes, masks = [], [], []
        for annotation in annotations:
            self._check_annotation(image_id, annotation, height, width)
            x, y, w, h = annotation["bbox"]
            labels.append(self.category_names[annotation["category_id"]])
            boxes.append([x, y, x + w, y + h])
            if annotation.get("segmentation"):
                try:
                    masks.append(self.coco.annToMask(annotation).astype(bool))
                except Exception as err:  # pycocotools raises bare exceptions on malformed RLE counts
                    raise DataError(f"{self.where(image_id, annotation.get('id'))}: segmentation cannot be "
                                    f"decoded: {err}") from err
            else:
                masks.append(np.zeros((height, width), dtype=bool))
        present = set(labels)
        if self.lvis:
            absent = [self.category_names[c] for c in info.get("neg_category_ids", []) if c in self.category_names]
        else:
            absent = [name for name in self.category_names.values() if name not in present]
        return GroundedImage(
            image=image, labels=labels, boxes=torch.tensor(boxes, dtype=torch.float).reshape(-1, 4),
            masks=torch.from_numpy(np.stack(masks)) if masks else torch.zeros(0, height, width, dtype=torch.bool),
            absent=sorted(set(absent) - present), source=f"{self.path.name}: image {image_id} ({file.name})",
        )


class GroundingSplit:
    """The seeded split of one concept's images: evaluation, gate (validation) and training images."""

    def __init__(self, annotations: GroundingAnnotations, concept: str | int, max_images: int, num_val_images: int,
                 num_eval_images: int, split_seed: int) -> None:
        self.category_id = annotations.category_id(concept)
        self.concept = annotations.category_names[self.category_id]
        ids = annotations.images_of(self.category_id)
        order = np.random.default_rng(split_seed).permutation(len(ids))
        shuffled = [ids[i] for i in order]
        self.eval_ids = shuffled[:num_eval_images]
        self.val_ids = shuffled[num_eval_images : num_eval_images + num_val_images]
        self.train_ids = shuffled[num_eval_images + num_val_images :][:max_images]
        if not self.train_ids:
            raise DataError(f"{annotations.path}: {self.concept!r} has {len(ids)} images: none left for training "
                            f"after {num_eval_images} evaluation and {num_val_images} validation images")
        if num_val_images and len(self.val_ids) < num_val_images:
            raise DataError(f"{annotations.path}: {self.concept!r} has too few images for {num_val_images} "
                            "validation images")


class GroundingInstances:
    """Map-style dataset: one :class:`GroundingInstance` per training image of the concept."""

    def __init__(self, annotations: GroundingAnnotations, split: GroundingSplit, val_images_per_instance: int) -> None:
        self.annotations, self.split = annotations, split
        # Check every image used now (missing files, bad annotations), not halfway through training.
        self.val_images = [annotations.grounded_image(i) for i in split.val_ids]
        for image_id in split.train_ids:
            annotations.grounded_image(image_id)
        self.per_instance = min(val_images_per_instance, len(self.val_images))
        self.instance_ids = [f"{split.concept}:{image_id}" for image_id in split.train_ids]

    def __len__(self) -> int:
        return len(self.instance_ids)

    def __getitem__(self, index: int) -> GroundingInstance:
        val = [self.val_images[(index * self.per_instance + j) % len(self.val_images)] for j in range(self.per_instance)]
        return GroundingInstance(instance_id=self.instance_ids[index], concept=self.split.concept,
                                 train=self.annotations.grounded_image(self.split.train_ids[index]), val=val)
