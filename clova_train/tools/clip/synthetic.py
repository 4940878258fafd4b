"""CLIP's synthetic data: concept folders (``root/<concept>/<concept>_<k>.png``) of single rendered shapes, the
layout :class:`~clova_train.datamodules.ConceptFolderDataModule` reads."""

from __future__ import annotations

import os
import tempfile
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

from clova_train.core.atomic import default_mode
from clova_train.synthetic.shapes import COLOURS, SHAPES, render_scene


def write_concept_folders(
    root: str | Path,
    concepts: list[str],
    images_per_concept: int = 7,
    image_size: int = 64,
    seed: int = 0,
) -> Path:
    """Write ``root/<concept>/<concept>_<k>.png`` images of single shapes.

    A concept is ``"<colour>_<shape>"`` (e.g. ``"red_circle"``) or a bare colour (any shape of that colour).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for concept in concepts:
        rng = np.random.default_rng([seed, zlib.crc32(concept.encode())])
        colour, _, shape = concept.partition("_")
        if colour not in COLOURS or (shape and shape not in SHAPES):
            raise ValueError(
                f"synthetic concept {concept!r} must be '<colour>' or '<colour>_<shape>' with colour in "
                f"{sorted(COLOURS)} and shape in {list(SHAPES)}"
            )
        # Render into a temporary folder and rename, so an interrupted run leaves no half-filled concept.
        staging = Path(tempfile.mkdtemp(prefix=f".{concept}.", dir=root))
        os.chmod(staging, default_mode(directory=True))
        for k in range(images_per_concept):
            kind = shape or SHAPES[int(rng.integers(len(SHAPES)))]
            scene = render_scene([(colour, kind)], size=image_size, rng=rng)
            Image.fromarray(scene.image).save(staging / f"{concept}_{k:03d}.png")
        os.replace(staging, root / concept)
    return root
