"""Synthetic open-vocabulary grounding data in COCO format (boxes and masks of rendered shapes).

``write_coco_scenes(root, ...)`` writes ``root/images/*.png`` and ``root/annotations.json``: a COCO
detection/instance-segmentation file that the grounding datamodule reads with pycocotools, exactly like a
COCO or LVIS download. Categories are ``"<colour> <shape>"`` names (``"purple circle"``); each object has
its ``bbox`` (``[x, y, w, h]``, pixels), ``area`` and ``segmentation``: a polygon for squares and
triangles, an RLE (pycocotools' own encoder) for circles, so both encodings go through the reader.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from clova_train.core.atomic import default_mode
from clova_train.synthetic.shapes import COLOURS, SHAPES, Scene, ShapeObject, render_scene

GROUNDING_OBJECT_SIZE = (0.3, 0.45)  # sides as a fraction of the image: 2 shapes fit without overlap


def category_name(colour: str, shape: str) -> str:
    return f"{colour} {shape}"


def all_categories() -> list[str]:
    return [category_name(c, s) for c in COLOURS for s in SHAPES]


def random_scene(
    rng: np.random.Generator, size: int, concept: tuple[str, str] | None, colours: list[str], objects: int,
    palette: dict[str, tuple[int, int, int]] | None = None,
) -> Scene:
    """A scene with ``concept`` (when given) and ``objects - 1`` other shapes of ``colours``, all distinct
    (``palette`` overrides the RGB of some colour names)."""
    chosen: list[tuple[str, str]] = [concept] if concept else []
    while len(chosen) < objects:
        item = (colours[int(rng.integers(len(colours)))], SHAPES[int(rng.integers(len(SHAPES)))])
        if item not in chosen:
            chosen.append(item)
    order = rng.permutation(len(chosen))
    return render_scene([chosen[i] for i in order], size=size, rng=rng, palette=palette, object_size=GROUNDING_OBJECT_SIZE)


def segmentation_of(obj: ShapeObject) -> list[list[float]] | dict:
    """COCO segmentation of a rendered shape: polygon for squares and triangles, RLE for circles."""
    x0, y0, x1, y1 = obj.box
    if obj.shape == "square":
        return [[x0, y0, x1 + 1, y0, x1 + 1, y1 + 1, x0, y1 + 1]]
    if obj.shape == "triangle":
        return [[(x0 + x1 + 1) / 2, y0, x1 + 1, y1 + 1, x0, y1 + 1]]
    from pycocotools import mask as mask_utils

    rle = mask_utils.encode(np.asfortranarray(obj.mask.astype(np.uint8)))
    return {"size": [int(s) for s in rle["size"]], "counts": rle["counts"].decode("ascii")}


def coco_annotation(obj: ShapeObject, annotation_id: int, image_id: int, category_id: int) -> dict:
    x0, y0, x1, y1 = obj.box
    return {
        "id": annotation_id, "image_id": image_id, "category_id": category_id, "iscrowd": 0,
        "bbox": [float(x0), float(y0), float(x1 - x0 + 1), float(y1 - y0 + 1)],
        "area": float(obj.mask.sum()), "segmentation": segmentation_of(obj),
    }


def write_coco_scenes(
    root: str | Path,
    concepts: list[str],
    images_per_concept: int = 10,
    distractor_colours: list[str] | None = None,
    objects_per_image: int = 3,
    image_size: int = 64,
    seed: int = 0,
) -> Path:
    """Write ``images_per_concept`` scenes per concept (``"<colour> <shape>"``), each with distractors.

    Every other object in a scene has a colour of ``distractor_colours`` (default: the standard colours
    other than the concepts'); every object is annotated. Returns ``root``.
    """
    root = Path(root)
    known = set(all_categories())
    parsed = []
    for concept in concepts:
        if concept not in known:
            raise ValueError(f"synthetic concept {concept!r} must be '<colour> <shape>', one of {sorted(known)}")
        colour, shape = concept.split(" ")
        parsed.append((colour, shape))
    colours = distractor_colours or [c for c in COLOURS if c not in {p[0] for p in parsed}]
    rng = np.random.default_rng(seed)
    scenes = []
    for concept in parsed:
        for _ in range(images_per_concept):
            scenes.append(random_scene(rng, image_size, concept, colours, objects_per_image))
    write_coco(root, scenes)
    return root


def write_coco(root: Path, scenes: list[Scene]) -> Path:
    """Write ``scenes`` as ``root/images/<k>.png`` + ``root/annotations.json`` (images first, the JSON last)."""
    root.mkdir(parents=True, exist_ok=True)
    categories = {name: k for k, name in enumerate(all_categories(), 1)}
    images, annotations = [], []
    staging = Path(tempfile.mkdtemp(prefix=".images.", dir=root))
    os.chmod(staging, default_mode(directory=True))
    for image_id, scene in enumerate(scenes, 1):
        file_name = f"{image_id:05d}.png"
        Image.fromarray(scene.image).save(staging / file_name)
        height, width = scene.image.shape[:2]
        images.append({"id": image_id, "file_name": file_name, "height": height, "width": width})
        for obj in scene.objects:
            annotations.append(coco_annotation(obj, len(annotations) + 1, image_id, categories[obj.label.replace("_", " ")]))
    target = root / "images"
    if target.exists():
        shutil.rmtree(target)
    os.replace(staging, target)
    coco = {
        "info": {"description": "clova-train synthetic shapes"},
        "images": images, "annotations": annotations,
        "categories": [{"id": k, "name": name, "supercategory": "shape"} for name, k in categories.items()],
    }
    from clova_train.core.atomic import write_json_atomic

    write_json_atomic(root / "annotations.json", coco)
    return root


def scene_targets(scene: Scene, categories: list[str]) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(category index, xyxy box, mask) of every object of ``scene`` whose name is in ``categories``."""
    labels, boxes, masks = [], [], []
    for obj in scene.objects:
        name = obj.label.replace("_", " ")
        if name in categories:
            labels.append(categories.index(name))
            x0, y0, x1, y1 = obj.box
            boxes.append([x0, y0, x1 + 1, y1 + 1])
            masks.append(obj.mask)
    size = scene.image.shape[0]
    return labels, np.array(boxes, dtype=np.float32).reshape(-1, 4), np.array(masks, dtype=bool).reshape(-1, size, size)
