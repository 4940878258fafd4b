"""A depth request: ``{"image": <file path>, "boxes": [[x0, y0, x1, y1], ...]}`` checked before any pixel is read.

Boxes are in pixels of the image as stored, y from the top (PIL's and COCO's ``xyxy``). A box covers the pixels it
overlaps: columns ``floor(x0)`` to ``ceil(x1) - 1`` and rows likewise, at least one of each (a zero-width box covers
the column it lies in). A box reaching past the image is clipped to it; one covering no pixel of the image is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from clova_train.core.checks import is_number
from clova_train.core.errors import DataError

REQUEST_FIELDS = ("image", "boxes")


@dataclass(frozen=True)
class DepthRequest:
    """A checked depth request.

    Args:
        image: path of the image file.
        boxes: ``(x0, y0, x1, y1)`` boxes in pixels, y from the top; empty: the whole image.
    """

    image: str
    boxes: tuple[tuple[float, float, float, float], ...] = ()


def parse_depth_request(request: Any) -> DepthRequest:
    """``request`` (a parsed JSON object) as a :class:`DepthRequest`, or a :class:`DataError` naming the field."""
    if not isinstance(request, dict):
        raise DataError(f"a depth request must be a JSON object with 'image' and optional 'boxes', got a "
                        f"{type(request).__name__}")
    unknown = sorted(str(name) for name in request if name not in REQUEST_FIELDS)
    if unknown:
        raise DataError(f"request field {unknown[0]!r} is not known to the depth tool (it takes "
                        f"{', '.join(repr(f) for f in REQUEST_FIELDS)})")
    image = request.get("image")
    if not isinstance(image, str) or not image.strip():
        raise DataError("request field 'image' must be the path of an image file (or a data: URL over HTTP)")
    boxes = request.get("boxes")
    if boxes is None:
        return DepthRequest(image)
    if not isinstance(boxes, list):
        raise DataError(f"request field 'boxes' must be a list of [x0, y0, x1, y1] boxes, got a {type(boxes).__name__}")
    return DepthRequest(image, tuple(_box(box, f"boxes[{index}]") for index, box in enumerate(boxes)))


def _box(value: Any, where: str) -> tuple[float, float, float, float]:
    if not isinstance(value, list) or len(value) != 4 or not all(is_number(v) for v in value):
        raise DataError(f"request field {where!r} must be four finite numbers [x0, y0, x1, y1] (pixels, y from the "
                        f"top), got {str(value)[:80]}")
    x0, y0, x1, y1 = (float(v) for v in value)
    if x1 < x0 or y1 < y0:
        raise DataError(f"request field {where!r} = {value} has x1 < x0 or y1 < y0 (expected [x0, y0, x1, y1], "
                        "pixels, y from the top)")
    return x0, y0, x1, y1


def box_pixels(box: tuple[float, float, float, float], width: int, height: int,
               where: str) -> tuple[slice, slice]:
    """The rows and columns of a ``width`` x ``height`` image that ``box`` covers (clipped to the image), or a
    :class:`DataError` naming ``where`` when it covers none of them."""
    x0, y0, x1, y1 = box
    columns = _covered(x0, x1, width)
    rows = _covered(y0, y1, height)
    if columns is None or rows is None:
        raise DataError(f"request field {where!r} = {list(box)} lies outside the {width}x{height} image")
    return rows, columns


def _covered(start: float, end: float, size: int) -> slice | None:
    first = math.floor(start)
    stop = max(math.ceil(end), first + 1)
    first, stop = max(first, 0), min(stop, size)
    return slice(first, stop) if first < stop else None
