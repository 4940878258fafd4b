"""Synthetic data of the REPLACE tool: one shape per image, with the mask of the region to repaint.

The mask is the shape's bounding box grown by one pixel: an inpainting model repaints that region, and the
concept must fill it. Objects are large and the background nearly flat (``background_noise`` 4), so that at
the tiny pipeline's 16 px the shape, not the noise, is what a loss sees.

Layout written by :func:`write_masked_concepts` (what ``MaskedConceptDataModule`` reads)::

    root/<concept>/<concept>_000.png
    root/<concept>/masks/<concept>_000.png     white (255) = the region to repaint
"""

from __future__ import annotations

import os
import tempfile
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

from clova_train.core.atomic import default_mode
from clova_train.synthetic.shapes import COLOURS, SHAPES, render_scene

OBJECT_SIZE = (0.4, 0.7)
BACKGROUND_NOISE = 4.0


def box_mask(box: tuple[int, int, int, int], size: int, grow: int = 1) -> np.ndarray:
    """``[size, size]`` uint8 mask (255 inside) of ``box`` grown by ``grow`` pixels, clipped to the image."""
    x0, y0, x1, y1 = box
    mask = np.zeros((size, size), dtype=np.uint8)
    mask[max(0, y0 - grow) : min(size, y1 + grow + 1), max(0, x0 - grow) : min(size, x1 + grow + 1)] = 255
    return mask


def masked_shape(
    rng: np.random.Generator, colour: str, shape: str, size: int, palette: dict[str, tuple[int, int, int]] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(``[size, size, 3]`` uint8 image of one shape, ``[size, size]`` uint8 mask of its grown box)."""
    scene = render_scene([(colour, shape)], size=size, rng=rng, palette=palette, object_size=OBJECT_SIZE,
                         background_noise=BACKGROUND_NOISE)
    return scene.image, box_mask(scene.objects[0].box, size)


def write_masked_concepts(
    root: str | Path, concepts: list[str], images_per_concept: int = 8, image_size: int = 16, seed: int = 0
) -> Path:
    """Write ``root/<concept>/*.png`` and their ``masks/`` for ``"<colour>_<shape>"`` concepts (see module doc)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for concept in concepts:
        colour, _, shape = concept.partition("_")
        if colour not in COLOURS or shape not in SHAPES:
            raise ValueError(f"synthetic masked concept {concept!r} must be '<colour>_<shape>' with colour in "
                             f"{sorted(COLOURS)} and shape in {list(SHAPES)}")
        rng = np.random.default_rng([seed, zlib.crc32(concept.encode())])
        # Written into a temporary folder and renamed: an interrupted run leaves no half-written concept.
        staging = Path(tempfile.mkdtemp(prefix=f".{concept}.", dir=root))
        os.chmod(staging, default_mode(directory=True))
        (staging / "masks").mkdir()
        for k in range(images_per_concept):
            image, mask = masked_shape(rng, colour, shape, image_size)
            Image.fromarray(image).save(staging / f"{concept}_{k:03d}.png")
            Image.fromarray(mask).save(staging / "masks" / f"{concept}_{k:03d}.png")
        os.chmod(staging, 0o755)
        if (root / concept).exists():
            raise FileExistsError(f"{root / concept} already exists")
        os.replace(staging, root / concept)
    return root
