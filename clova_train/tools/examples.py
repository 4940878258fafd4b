"""Files for example requests: a random image and a square mask, written where a recipe's ``example_request`` (the
conformance suite's served query) needs them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def random_image(path: Path, size: int = 32, seed: int = 0) -> str:
    """Write a ``size`` x ``size`` RGB image of uniform noise to ``path``; its path as a string."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return str(path)


def square_mask(path: Path, size: int = 16) -> str:
    """Write a ``size`` x ``size`` mask whose middle half (a square) is set to ``path``; its path as a string."""
    mask = np.zeros((size, size), dtype=np.uint8)
    mask[size // 4 : 3 * size // 4, size // 4 : 3 * size // 4] = 255
    Image.fromarray(mask).save(path)
    return str(path)
