"""Reading images for tools, datamodules and serving: one place, one error kind naming the file."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from clova_train.core.errors import DataError
from clova_train.core.safe_files import open_regular, printable

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}
_READ_ERRORS = (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError)


display_path = printable  # ``path`` printable in any terminal (bytes of a name that are not UTF-8 shown escaped)


class SkippedNameWarning(UserWarning):
    """Entries of a folder skipped because their names are not text (see :func:`text_named`)."""


def is_text_name(path: Path) -> bool:
    """Whether ``path``'s name is text: on POSIX a name whose bytes are not UTF-8 (``b'bad\\xff.png'``) comes from
    the OS with surrogates in it, which opens as a path but cannot be encoded, hashed, logged or written as text."""
    try:
        path.name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def text_named(paths: Iterable[Path], folder: Path, what: str) -> list[Path]:
    """The ``paths`` (entries of ``folder``) whose names are text; the others are skipped with one
    :class:`SkippedNameWarning` that counts them and shows the first (their names would become concepts, instance
    ids and report lines)."""
    kept, skipped = [], []
    for path in paths:
        (kept if is_text_name(path) else skipped).append(path)
    if skipped:
        warnings.warn(f"{display_path(folder)}: skipped {len(skipped)} {what}{'s' if len(skipped) > 1 else ''} whose "
                      f"name is not UTF-8 text (first: {os.fsencode(skipped[0].name)!r}); rename "
                      f"{'them' if len(skipped) > 1 else 'it'} to use {'them' if len(skipped) > 1 else 'it'}",
                      SkippedNameWarning, stacklevel=2)
    return kept


def list_images(folder: Path) -> list[Path]:
    """The image files of ``folder`` (by suffix), sorted; names that are not text are skipped with a warning."""
    found = [p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()]
    return sorted(text_named(found, folder, "image"))


class ImageReadError(DataError):
    """An image that cannot be read: missing, not a regular file, unreadable, not an image, or too large.

    ``path`` is the image as it was named (a server answers every such failure with one message, so that a client
    cannot tell which files exist on the server)."""

    def __init__(self, message: str, path: str | Path) -> None:
        super().__init__(message)
        self.path = str(path)


def _bomb_message(path: Path, err: BaseException) -> str:
    return (f"image {display_path(path)} is too large to decode safely ({err}); resize it, or raise "
            "PIL.Image.MAX_IMAGE_PIXELS if it is trusted")


@contextmanager
def _reading(path: Path) -> Iterator[None]:
    """Turn PIL's many failure kinds into one :class:`ImageReadError` naming ``path``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield
    except ImageReadError:
        raise
    except DataError as err:  # not a regular file
        raise ImageReadError(str(err), path) from err
    except FileNotFoundError as err:
        raise ImageReadError(f"image not found: {display_path(path)}", path) from err
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise ImageReadError(_bomb_message(path, err), path) from err
    except _READ_ERRORS as err:
        raise ImageReadError(f"unreadable image {display_path(path)}: {err}", path) from err


def check_image(path: Path) -> None:
    """Raise :class:`DataError` naming ``path`` if it is not a readable image (without decoding its pixels)."""
    with _reading(path), open_regular(path, "image") as handle, Image.open(handle) as img:
        img.verify()


def image_size(path: Path, formats: tuple[str, ...] | None = None) -> tuple[int, int]:
    """``(width, height)`` from the image's header (no pixel decoded), or a :class:`DataError` naming it;
    ``formats`` limits the decoders PIL may try (for bytes a client sent)."""
    with _reading(path), open_regular(path, "image") as handle, Image.open(handle, formats=formats) as img:
        return img.size


def open_rgb(path: Path) -> Image.Image:
    """The image at ``path`` as 8-bit RGB, or a :class:`DataError` naming it.

    Images whose header claims more than PIL's ``MAX_IMAGE_PIXELS`` are refused before decoding (a
    decompression bomb); 16-bit and 32-bit integer images are scaled to 8 bits, not clipped to white.
    """
    with _reading(path), open_regular(path, "image") as handle, Image.open(handle) as img:
        return _to_rgb(img, path)


def _to_rgb(img: Image.Image, path: Path) -> Image.Image:
    if img.mode.startswith("I;16") or img.mode == "I":
        # PNG stores 16-bit greyscale; PIL's convert("RGB") would clip every value above 255 to white.
        values = np.asarray(img, dtype=np.float64)
        scaled = np.clip(np.round(values / 257.0), 0, 255).astype(np.uint8)
        return Image.fromarray(scaled, mode="L").convert("RGB")
    if img.mode == "F":
        raise ImageReadError(f"image {display_path(path)} has floating-point pixels; save it as 8- or 16-bit", path)
    return img.convert("RGB")


def load_image(path: Path, size: int) -> torch.Tensor:
    """``[3, size, size]`` float tensor in [0, 1]: the shorter side resized to ``size`` (bicubic), then the
    centre crop, as open_clip's own evaluation transform does (a non-square image is not squashed)."""
    from torchvision.transforms import CenterCrop, InterpolationMode, Resize

    rgb = CenterCrop(size)(Resize(size, interpolation=InterpolationMode.BICUBIC)(open_rgb(Path(path))))
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
