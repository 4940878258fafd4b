"""Synthetic visual data: rendered coloured shapes with known labels, boxes, masks and Q/A pairs.

Every tool's tests and quickstarts use this generator instead of downloaded datasets. A scene holds one
or more shapes on a noisy background; each shape has a colour, a kind, a bounding box and a mask, so the
same scene serves classification (CLIP), detection (OWL-ViT), segmentation (MaskFormer) and VQA (BLIP).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 180, 40),
    "blue": (30, 60, 220),
    "yellow": (235, 215, 30),
    "purple": (140, 40, 170),
    "orange": (245, 140, 20),
}
SHAPES = ("circle", "square", "triangle")


@dataclass
class ShapeObject:
    """One rendered shape: its labels, box ``(x0, y0, x1, y1)`` in pixels, and boolean mask."""

    colour: str
    shape: str
    box: tuple[int, int, int, int]
    mask: np.ndarray = field(repr=False)

    @property
    def label(self) -> str:
        return f"{self.colour}_{self.shape}"


@dataclass
class Scene:
    """An RGB image with its objects and question/answer pairs about them."""

    image: np.ndarray  # [H, W, 3] uint8
    objects: list[ShapeObject]
    qa_pairs: list[tuple[str, str]]


def _draw(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], fill: tuple[int, int, int]) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "triangle":
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")


def render_scene(
    objects: list[tuple[str, str]],
    size: int = 64,
    rng: np.random.Generator | None = None,
    palette: dict[str, tuple[int, int, int]] | None = None,
    object_size: tuple[float, float] = (0.25, 0.5),
    background_noise: float = 12.0,
    spacing: float = 1.0,
) -> Scene:
    """Render ``objects`` (``(colour, shape)`` pairs) at random non-overlapping places on a noisy background.

    ``palette`` overrides the RGB of some colour names (default :data:`COLOURS`); each object's side is a
    random fraction of ``size`` in ``object_size``; ``background_noise`` is the standard deviation of the
    background's per-pixel noise. ``spacing`` > 1 keeps each object out of the square ``spacing`` times another's
    side around it, so crops of that size show one object (best effort: 50 tries per object).
    """
    palette = {**COLOURS, **(palette or {})}
    rng = rng or np.random.default_rng()
    background = rng.integers(90, 170, size=3)
    noise = rng.normal(0, background_noise, size=(size, size, 3))
    canvas = np.clip(background[None, None, :] + noise, 0, 255).astype(np.uint8)
    image = Image.fromarray(canvas)
    placed: list[ShapeObject] = []
    for colour, shape in objects:
        for _ in range(50):
            side = int(rng.integers(max(1, int(size * object_size[0])), int(size * object_size[1]) + 1))
            x0 = int(rng.integers(0, size - side + 1))
            y0 = int(rng.integers(0, size - side + 1))
            box = (x0, y0, x0 + side - 1, y0 + side - 1)
            if all(_disjoint(_grown(box, spacing), other.box) and _disjoint(box, _grown(other.box, spacing))
                   for other in placed):
                break
        jitter = rng.integers(-20, 21, size=3)
        fill = tuple(int(v) for v in np.clip(np.array(palette[colour]) + jitter, 0, 255))
        mask_image = Image.new("L", (size, size), 0)
        _draw(ImageDraw.Draw(mask_image), shape, box, 255)
        _draw(ImageDraw.Draw(image), shape, box, fill)
        placed.append(ShapeObject(colour, shape, box, np.array(mask_image) > 0))
    qa = []
    for obj in placed:
        qa.append((f"What colour is the {obj.shape}?", obj.colour))
        qa.append((f"What shape is the {obj.colour} object?", obj.shape))
    qa.append(("How many shapes are there?", str(len(placed))))
    return Scene(np.array(image), placed, qa)


def _grown(box: tuple[int, int, int, int], factor: float) -> tuple[int, int, int, int]:
    if factor == 1.0:
        return box
    x0, y0, x1, y1 = box
    side = max(x1 - x0, y1 - y0) * factor / 2
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    return int(cx - side), int(cy - side), int(cx + side), int(cy + side)


def _disjoint(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> bool:
    return a[2] < b[0] or b[2] < a[0] or a[3] < b[1] or b[3] < a[1]


def generated_before(root: str | Path, parameters: dict) -> bool:
    """Whether ``root`` was generated with ``parameters`` (its ``synthetic.json``); raises if with others.

    Generators call this first and :func:`record_generation` when they are done, so an interrupted run
    generates again and a changed configuration is an error rather than silently reused data.
    """
    from clova_train.core.errors import DataError

    record = Path(root) / "synthetic.json"
    if not record.is_file():
        return False
    from clova_train.core.safe_files import read_json

    found = read_json(record, "synthetic data record")
    if found != parameters:
        raise DataError(f"{root} was generated with {found}, not {parameters}: remove it or choose another root")
    return True


def record_generation(root: str | Path, parameters: dict) -> None:
    from clova_train.core.atomic import write_json_atomic

    write_json_atomic(Path(root) / "synthetic.json", parameters)
