"""Reading images for tools, datamodules and serving: one place, one error kind naming the file."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from clova_train.core.errors import DataError

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}
_READ_ERRORS = (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError)


def list_images(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def check_image(path: Path) -> None:
    """Raise :class:`DataError` naming ``path`` if it is not a readable image."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                img.verify()
    except FileNotFoundError as err:
        raise DataError(f"image not found: {path}") from err
    except (*_READ_ERRORS, Image.DecompressionBombWarning) as err:
        raise DataError(f"unreadable image {path}: {err}") from err


def open_rgb(path: Path) -> Image.Image:
    """The image at ``path`` as RGB, or a :class:`DataError` naming it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                return img.convert("RGB")
    except FileNotFoundError as err:
        raise DataError(f"image not found: {path}") from err
    except (*_READ_ERRORS, Image.DecompressionBombWarning) as err:
        raise DataError(f"unreadable image {path}: {err}") from err


def load_image(path: Path, size: int) -> torch.Tensor:
    """``[3, size, size]`` float tensor in [0, 1]."""
    rgb = open_rgb(Path(path)).resize((size, size), Image.BICUBIC)
    data = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
    return data.view(size, size, 3).permute(2, 0, 1).float() / 255.0


def load_image_uint8(path: Path) -> torch.Tensor:
    """``[3, H, W]`` uint8 tensor of the image at ``path`` as stored (tools with their own processor)."""
    return torch.from_numpy(np.asarray(open_rgb(Path(path)), dtype=np.uint8).copy()).permute(2, 0, 1)


def load_images(paths: Any, size: int, field: str) -> torch.Tensor:
    """``[N, 3, size, size]`` from a request's list of image paths (``field`` names it in errors)."""
    if isinstance(paths, str):
        paths = [paths]
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) for p in paths):
        raise DataError(f"request field {field!r} must be an image path or a non-empty list of them")
    return torch.stack([load_image(Path(p), size) for p in paths])
