"""Images sent inside a request: ``data:`` URLs (RFC 2397, as OpenAI's image inputs take them) and uploads.

A prompt tool reads its images from files, so :func:`materialised_images` writes each ``data:`` URL of a request's
image fields to a private temporary directory for the length of the request, hands the tool those paths instead,
and removes the files afterwards. Server paths pass through :func:`confined_server_paths` first where the caller is
a server (a client names them): refused unless the operator named an image root, then confined to it. Multipart uploads reach it as ``data:`` URLs
too (the request guard converts them, :func:`as_data_url`). The HTTP server (``clova_train.serving``) and the
in-process tool client (:class:`~clova_train.tools.tool_clients.LocalToolClient`) share this one implementation.
"""

from __future__ import annotations

import base64
import binascii
import os
import tempfile
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from clova_train.core.errors import DataError

IMAGE_FIELDS = ("image", "images", "mask")  # the request fields that name images, over every prompt tool
SENT_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # decoders PIL may use on bytes a client sent
SUFFIXES = {"image/png": ".png", "image/jpeg": ".jpg", "image/webp": ".webp", "image/gif": ".gif", "image/bmp": ".bmp",
            "image/tiff": ".tif"}


def as_data_url(data: bytes, media_type: str | None) -> str:
    """``data:<media type>;base64,<data>`` (an upload without a type is sent as ``application/octet-stream``)."""
    media_type = (media_type or "application/octet-stream").split(";")[0].strip() or "application/octet-stream"
    return f"data:{media_type};base64,{base64.b64encode(data).decode('ascii')}"


def parse_data_url(url: str, where: str) -> tuple[str, bytes]:
    """The media type and bytes of a ``data:`` URL, or a :class:`DataError` naming ``where``."""
    header, comma, payload = url[len("data:"):].partition(",")
    if not comma:
        raise DataError(f"{where} is not a valid data: URL (expected data:image/png;base64,<data>)")
    parameters = [p.strip().lower() for p in header.split(";")]
    media_type = parameters[0] or "text/plain"
    if media_type != "application/octet-stream" and not media_type.startswith("image/"):
        raise DataError(f"{where} is a data: URL of {media_type!r}, not an image")
    try:
        if "base64" in parameters[1:]:
            data = base64.b64decode(payload.strip(), validate=True)
        else:
            data = urllib.parse.unquote_to_bytes(payload)
    except (binascii.Error, ValueError):
        raise DataError(f"{where} is a data: URL whose base64 data is malformed") from None
    if not data:
        raise DataError(f"{where} is an empty data: URL")
    return media_type, data


@contextmanager
def materialised_images(request: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, str]]]:
    """``request`` with every ``data:`` URL of its image fields replaced by a temporary file's path (removed on
    exit), and which field each such path came from (for error messages); a request without any is yielded as
    it is."""
    if not any(_has_data_url(request.get(name)) for name in IMAGE_FIELDS):
        yield request, {}
        return
    with tempfile.TemporaryDirectory(prefix="clova-train-request-") as directory:
        origins: dict[str, str] = {}

        def to_path(value: Any, where: str) -> Any:
            if not (isinstance(value, str) and value.startswith("data:")):
                return value
            media_type, data = parse_data_url(value, where)
            path = Path(directory) / f"image-{len(origins) + 1}{SUFFIXES.get(media_type, '')}"
            path.write_bytes(data)
            origins[str(path)] = where
            return str(path)

        yield with_image_fields(request, to_path), origins


def image_paths(request: dict[str, Any]) -> list[str]:
    """Every image path a (materialised) request names, over the image fields."""
    paths = []
    for name in IMAGE_FIELDS:
        value = request.get(name)
        paths += [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, str)]
    return paths


def check_request_pixels(request: dict[str, Any], origins: dict[str, str], max_request_pixels: int) -> None:
    """Refuse, from the images' headers alone, a request whose images hold more than ``max_request_pixels``
    together (:class:`RequestTooLarge`), or that sent an image that is not one in :data:`SENT_FORMATS` within the
    per-image limit (``ImageReadError`` of its temporary file; ``origins`` maps those to their fields). A server
    path whose header cannot be read is left to the tool, which answers every such image the same way."""
    from clova_train.tools.images import ImageReadError, image_size

    total = 0
    for path in image_paths(request):
        sent = path in origins
        try:
            width, height = image_size(Path(path), SENT_FORMATS if sent else None)
        except ImageReadError:
            if sent:  # the server names the field: not a readable image in an accepted format and size
                raise
            continue
        total += width * height
        if total > max_request_pixels:
            raise RequestTooLarge(f"the request's images hold more than {max_request_pixels:,} pixels together, the "
                                  "most this server decodes for one request: send fewer or smaller images")


class RequestTooLarge(DataError):
    """A request whose images together are more than the server decodes for one request (HTTP 413)."""


def with_image_fields(request: dict[str, Any], convert: Callable[[Any, str], Any]) -> dict[str, Any]:
    """A copy of ``request`` with each value of its image fields (each item of a list) replaced by ``convert(value,
    where)``, ``where`` naming the field (and index) for messages."""
    converted = dict(request)
    for name in IMAGE_FIELDS:
        value = request.get(name)
        if isinstance(value, list):
            converted[name] = [convert(v, f"request field {name!r}[{i}]") for i, v in enumerate(value)]
        elif value is not None:
            converted[name] = convert(value, f"request field {name!r}")
    return converted


def _has_data_url(value: Any) -> bool:
    values = value if isinstance(value, list) else [value]
    return any(isinstance(v, str) and v.startswith("data:") for v in values)


class ServerPathRefused(DataError):
    """A request named a file on the server that the server does not read for clients."""


def confined_server_paths(request: dict[str, Any], image_root: Path | None,
                          given_names: dict[str, str] | None = None) -> dict[str, Any]:
    """``request`` with every server path of its image fields (a string that is no ``data:`` URL) resolved inside
    ``image_root`` (symbolic links followed), or a :class:`ServerPathRefused` naming the field. Without a root no server
    path is accepted; a path outside the root is refused from its text alone, before the file system is asked anything
    about it, so the answer and its timing say nothing about files outside the root. A relative path is taken from
    the root; ``image_root`` must be the root's resolved path (``os.path.realpath``). ``given_names`` (when given)
    receives each resolved path's name as the client wrote it, for answers that do not show the server's folders."""

    def confined(value: Any, where: str) -> Any:
        if not isinstance(value, str) or value.startswith("data:"):
            return value
        if image_root is None:
            raise ServerPathRefused(f"{where} names a file on the server, which this server does not read for clients "
                                    "(it was started without --image-root): send the image itself, as a data: URL or "
                                    "an upload")
        if "\x00" in value or not value.strip():
            raise ServerPathRefused(f"{where} is not a file name")
        lexical = os.path.normpath(os.path.join(image_root, value))
        if not _inside(lexical, image_root):
            raise ServerPathRefused(f"{where} names a file outside the server's --image-root: only files under it are "
                                    "read (or send the image itself, as a data: URL or an upload)")
        if not _inside(os.path.realpath(lexical), image_root):
            raise ServerPathRefused(f"{where} leads outside the server's --image-root (through a symbolic link)")
        if given_names is not None:
            given_names[lexical] = value
        return lexical

    return with_image_fields(request, confined)


def _inside(path: str, root: Path) -> bool:
    return path == str(root) or path.startswith(str(root).rstrip(os.sep) + os.sep)
