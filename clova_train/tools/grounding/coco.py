"""Reading open-vocabulary grounding data (COCO / LVIS annotation files): annotations, the split, instances.

No Lightning here: the grounding datamodule (``clova_train.datamodules.prompt_tuning.grounding``) and serving demos share it.

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
import math
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clova_train.core.errors import DataError
from clova_train.core.safe_files import read_json
from clova_train.tools.grounding.instances import GroundedImage, GroundingInstance
from clova_train.tools.images import load_image_uint8

EDGE_TOLERANCE = 1.0  # pixels: annotation tools round box and polygon edges


MAX_IMAGE_SIDE = 1 << 16  # pixels: masks are decoded at the size the file claims


def finite_numbers(values: list[Any]) -> bool:
    """Whether every value is a finite int or float (``True``, strings and NaN are not coordinates)."""
    return all(type(v) in (int, float) and math.isfinite(v) for v in values)


def compressed_rle_counts(counts: str) -> list[int] | None:
    """The run lengths of a COCO compressed RLE string (pycocotools' ``rleFrString``), or ``None`` if malformed."""
    runs: list[int] = []
    position = 0
    while position < len(counts):
        value, shift, more = 0, 0, True
        while more:
            if position >= len(counts):
                return None
            code = ord(counts[position]) - 48
            if not 0 <= code < 64:
                return None
            value |= (code & 0x1F) << (5 * shift)
            more = bool(code & 0x20)
            position += 1
            shift += 1
            if shift > 13:  # far beyond any image's pixel count
                return None
            if not more and code & 0x10:
                value |= -1 << (5 * shift)
        if len(runs) > 2:
            value += runs[-2]
        runs.append(value)
    return runs


def rle_problem(counts: Any, pixels: int) -> str | None:
    """Why an RLE's ``counts`` cannot describe an image of ``pixels`` pixels, or ``None``.

    pycocotools decodes runs into a buffer of the image's size without checking their sum, so runs are checked
    here: non-negative integers adding up to exactly the pixel count."""
    if isinstance(counts, str):
        runs = compressed_rle_counts(counts)
        if runs is None:
            return "RLE counts is not a valid compressed RLE string"
    elif isinstance(counts, list):
        if not all(type(v) is int for v in counts):
            return "RLE counts must be integers"
        runs = counts
    else:
        return "RLE without counts (a string or a list of integers)"
    if any(run < 0 for run in runs) or sum(runs) != pixels:
        return f"RLE counts are not non-negative runs adding up to the image's {pixels} pixels"
    return None


class GroundingAnnotations:
    """A COCO or LVIS annotation file, indexed by pycocotools, with checked access to its images.

    Args:
        path: the annotation JSON.
        image_root: folder of the image files (default: ``images/`` next to the file if it exists, else its folder).
    """

    def __init__(self, path: str | Path, image_root: str | Path | None = None) -> None:
        from pycocotools.coco import COCO

        self.path = Path(path)
        data = read_json(self.path, "annotation file")
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
        for number, image in enumerate(data["images"]):
            for key in ("height", "width"):
                if isinstance(image[key], bool) or not isinstance(image[key], int) or not 0 < image[key] <= MAX_IMAGE_SIDE:
                    raise DataError(f"{self.path}: images[{number}] {key} must be an integer in 1..{MAX_IMAGE_SIDE}, "
                                    f"got {image[key]!r:.40}")
        for kind in ("images", "categories", "annotations"):
            for number, record in enumerate(data[kind]):
                if isinstance(record["id"], (bool, float, dict, list)) or record["id"] is None:
                    raise DataError(f"{self.path}: {kind}[{number}] id must be an integer or a string, got {record['id']!r:.40}")
        ids = [image["id"] for image in data["images"]]
        if len(set(ids)) != len(ids):
            raise DataError(f"{self.path}: image ids are not unique")
        self._check_image_ids(data["annotations"], set(ids))

    def _check_image_ids(self, annotations: list[dict], image_ids: set[Any]) -> None:
        """Each annotation's ``image_id`` names an image of the file."""
        for number, annotation in enumerate(annotations):
            image_id = annotation["image_id"]
            if isinstance(image_id, (bool, float, dict, list)) or image_id is None or image_id not in image_ids:
                raise DataError(f"{self.path}: annotations[{number}] (id {annotation['id']!r:.40}) has image_id "
                                f"{image_id!r:.40}, which names no image of the file")

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
        if not (isinstance(box, list) and len(box) == 4 and finite_numbers(box)):
            raise DataError(f"{where}: bbox must be [x, y, width, height] of finite numbers, got {box!r:.120}")
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
            if not isinstance(size, list) or [type(v) for v in size] != [int, int] or size != [height, width]:
                raise DataError(f"{where}: RLE size {size!r:.40} does not match the image's [height, width] "
                                f"[{height}, {width}]")
            problem = rle_problem(segmentation.get("counts"), height * width)
            if problem:
                raise DataError(f"{where}: {problem}")
        elif isinstance(segmentation, list):
            for polygon in segmentation:
                if not (isinstance(polygon, list) and len(polygon) >= 6 and len(polygon) % 2 == 0):
                    raise DataError(f"{where}: a polygon is a list of at least 3 x, y pairs, got {polygon!r:.80}")
                if not finite_numbers(polygon):
                    raise DataError(f"{where}: a polygon's coordinates must be finite numbers, got {polygon!r:.80}")
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
