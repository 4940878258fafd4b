"""ViperGPT's ``ImagePatch`` tools backed by this package's exports, for HYDRA-style controllers and their environments.

:class:`ImagePatchTools` implements the sandbox's :class:`~clova_train.sandbox.ToolAPI` for one image: ``find`` /
``exists`` ask LOC (a prompt-tuned OWL-ViT export) on the patch's pixels, ``verify_property`` crops around each found
object and asks CLASSIFY (a CLIP export) which of the labels it shows, ``simple_query`` asks VQA (a BLIP export) about
the patch, ``compute_depth`` asks DEPTH for the patch's median depth in the whole image (larger: farther), ``llm_query`` asks the LLM it was
given. Every request goes through a :class:`~clova_train.tools.tool_clients.ToolClient` with images as PNG ``data:``
URLs, so the same code runs on models loaded in this process and on a ``clova-train serve`` of the same exports.

Sharing the models: :meth:`ImageToolsConfig.client` keeps ONE client per distinct tool setting per process (a
module-level cache keyed by the values that choose the client: export and model directories, server URL, API-key
variable, timeout, device, ``top_k``), so every environment of a process (a ``DummyVecEnv``, the evaluation
environment beside the training one) shares one loaded copy of each model. Processes share nothing: a
``SubprocVecEnv`` run shares one copy of the models across its worker processes by pointing ``server_url`` at one
``clova-train serve`` of those exports (each worker then holds only an HTTP client).

A tool that fails (a server refusing, timing out, answering malformed JSON; a model error) raises a
:class:`~clova_train.core.errors.ToolServiceError` (an unreadable image, its ``DataError``); the sandbox reports any
exception of a tool to the program as that call's failure, so the run ends as a failed program and the parent carries
on.
"""

from __future__ import annotations

import io
import math
import os
import threading
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from PIL import Image

from clova_train.core.checks import Problems, is_integer, is_number
from clova_train.core.errors import ClovaTrainError, DataError, ToolServiceError
from clova_train.tools.data_urls import as_data_url
from clova_train.tools.images import load_image_uint8
from clova_train.tools.tool_clients import (CLASSIFY, DEFAULT_API_KEY_ENV, DEPTH, LOC, VQA, HttpToolClient,
                                            LocalToolClient, MemoizedToolClient, ToolClient, describe_export)

Box = tuple[int, int, int, int]


class PatchBox(Protocol):
    """An image patch as the tools receive it (the sandbox's ``PatchRef``, a sibling package this one does not
    import): pixels, y measured from the bottom."""

    left: int
    lower: int
    right: int
    upper: int


DEFAULT_LABELS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white", "gray")
NO_DEPTH = 0.0  # compute_depth without a DEPTH tool: every patch equally deep, so comparisons of depth are all False
UNKNOWN = "unknown"  # simple_query without VQA, llm_query without an LLM
MAX_CROPS_PER_REQUEST = 64  # CLASSIFY crops per request (a server bounds a request's list lengths)
_CACHED_URLS = 32  # encoded regions kept per image (a program asks about the same patch several times)


def crop_around(box: Box, height: int, width: int, margin: float) -> tuple[int, int, int, int]:
    """Pixel columns and rows ``(x0, y0, x1, y1)`` (top-down, end-exclusive, at least one pixel) of the square around
    ``box`` (``(left, lower, right, upper)``, y from the bottom) whose side is ``margin`` times the box's longer side,
    clipped to the image: the object with some context, for the classifier."""
    left, lower, right, upper = box
    side = max(right - left, upper - lower, 1) * margin
    cx, cy = (left + right) / 2, height - (lower + upper) / 2
    x0 = min(max(0, int(cx - side / 2)), width - 1)
    y0 = min(max(0, int(cy - side / 2)), height - 1)
    x1 = max(min(width, int(math.ceil(cx + side / 2))), x0 + 1)
    y1 = max(min(height, int(math.ceil(cy + side / 2))), y0 + 1)
    return x0, y0, x1, y1


def patch_region(patch: PatchBox, height: int, width: int) -> tuple[int, int, int, int]:
    """The patch's pixel columns and rows ``(x0, y0, x1, y1)`` (top-down, end-exclusive), clipped to the image and
    at least one pixel (a program may crop to nothing or past the edges)."""
    x0 = min(max(patch.left, 0), width - 1)
    y0 = min(max(height - patch.upper, 0), height - 1)
    x1 = max(min(patch.right, width), x0 + 1)
    y1 = max(min(height - patch.lower, height), y0 + 1)
    return x0, y0, x1, y1


def png_data_url(pixels: np.ndarray) -> str:
    """``data:image/png;base64,...`` of an ``[H, W, 3]`` uint8 array."""
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode="RGB").save(buffer, format="PNG")
    return as_data_url(buffer.getvalue(), "image/png")


class ImagePatchTools:
    """The ``ImagePatch`` tools of one image (see the module docstring); implements the sandbox's ``ToolAPI``.

    Args:
        image: the image the program looks at (read once, on the first call that needs its pixels).
        client: answers the LOC, CLASSIFY, VQA and DEPTH requests (a role it lacks: ``find`` and
            ``verify_property`` fail, ``simple_query`` answers ``"unknown"``, ``compute_depth`` :data:`NO_DEPTH`).
        labels: the labels CLASSIFY chooses among in ``verify_property``; an attribute outside them is added for
            that call.
        crop_margin: ``verify_property`` classifies a square around each found object this many times the object's
            longer side (context for the classifier).
        llm: answers ``llm_query`` (a question in, a reply out); ``None``: ``"unknown"``.
    """

    def __init__(self, image: str | os.PathLike[str], client: ToolClient, labels: Sequence[str],
                 crop_margin: float = 2.0, llm: Callable[[str], str] | None = None) -> None:
        self.image_path = Path(image)
        self.client, self.labels, self.crop_margin, self.llm = client, list(labels), crop_margin, llm
        self._pixels: np.ndarray | None = None
        self._urls: dict[tuple[int, int, int, int], str] = {}

    @property
    def pixels(self) -> np.ndarray:
        """The image as an ``[H, W, 3]`` uint8 array (read on first use; a :class:`DataError` names a bad file)."""
        if self._pixels is None:
            self._pixels = load_image_uint8(self.image_path).permute(1, 2, 0).contiguous().numpy()
        return self._pixels

    @property
    def size(self) -> tuple[int, int]:
        """``(width, height)`` in pixels."""
        height, width = self.pixels.shape[:2]
        return width, height

    def region_url(self, region: tuple[int, int, int, int]) -> str:
        """The PNG ``data:`` URL of the pixels ``(x0, y0, x1, y1)`` (top-down, end-exclusive)."""
        url = self._urls.get(region)
        if url is None:
            if len(self._urls) >= _CACHED_URLS:
                self._urls.clear()
            x0, y0, x1, y1 = region
            url = self._urls[region] = png_data_url(np.ascontiguousarray(self.pixels[y0:y1, x0:x1]))
        return url

    # ------------------------------------------------------------------ ToolAPI
    def find(self, patch: PatchBox, object_name: str) -> list[Box]:
        """Boxes ``(left, lower, right, upper)`` in the whole image (y from the bottom) of ``object_name`` in the
        patch, as LOC finds them in the patch's pixels."""
        height, width = self.pixels.shape[:2]
        x0, y0, x1, y1 = region = patch_region(patch, height, width)
        reply = self.client.request(LOC, {"image": self.region_url(region), "concept": object_name.strip()})
        boxes = []
        for bx0, by0, bx1, by1 in _boxes(reply):
            # the detector's (x0, y0, x1, y1) are top-down pixels of the region; the API's have y from the bottom
            left, right = _clip(x0 + bx0, 0, width), _clip(x0 + bx1, 0, width)
            top, bottom = _clip(y0 + by0, 0, height), _clip(y0 + by1, 0, height)
            boxes.append((round(left), round(height - bottom), round(right), round(height - top)))
        return boxes

    def exists(self, patch: PatchBox, object_name: str) -> bool:
        return bool(self.find(patch, object_name))

    def verify_property(self, patch: PatchBox, object_name: str, attribute: str) -> bool:
        """Whether CLASSIFY labels any found ``object_name`` with ``attribute`` (False when none is found)."""
        boxes = self.find(patch, object_name)
        if not boxes:
            return False
        wanted = attribute.strip()
        label = next((known for known in self.labels if known.lower() == wanted.lower()), wanted)
        labels = self.labels if label in self.labels else [*self.labels, label]
        height, width = self.pixels.shape[:2]
        crops = [self.region_url(crop_around(box, height, width, self.crop_margin)) for box in boxes]
        for start in range(0, len(crops), MAX_CROPS_PER_REQUEST):
            chunk = crops[start:start + MAX_CROPS_PER_REQUEST]
            if label in _labels(self.client.request(CLASSIFY, {"images": chunk, "labels": labels}), len(chunk)):
                return True
        return False

    def label_of(self, patch: PatchBox) -> str:
        """CLASSIFY's label (one of ``labels``) for a square around the patch, the context ``verify_property`` gives
        a found object; ``"unknown"`` without a CLASSIFY tool."""
        if CLASSIFY not in self.client.roles:
            return UNKNOWN
        height, width = self.pixels.shape[:2]
        box = (patch.left, patch.lower, patch.right, patch.upper)
        crop = self.region_url(crop_around(box, height, width, self.crop_margin))
        return _labels(self.client.request(CLASSIFY, {"images": [crop], "labels": self.labels}), 1)[0]

    def simple_query(self, patch: PatchBox, question: str) -> str:
        """VQA's answer about the patch's pixels (``"unknown"`` without a VQA tool)."""
        if VQA not in self.client.roles:
            return UNKNOWN
        height, width = self.pixels.shape[:2]
        region = patch_region(patch, height, width)
        reply = self.client.request(VQA, {"image": self.region_url(region), "question": question})
        answer = reply.get("answer")
        if not isinstance(answer, str):
            raise ToolServiceError(f"{VQA} tool replied without an 'answer' text: {_shown(reply)}")
        return answer

    def compute_depth(self, patch: PatchBox) -> float:
        """The patch's median depth, larger meaning farther as ViperGPT's API has it (its example sorts patches by
        ``compute_depth`` and takes the last as the furthest); :data:`NO_DEPTH` without a DEPTH tool.

        The depth model sees the whole image and takes the median over the patch's box. A model whose larger values
        are nearer (relative inverse depth: DPT/MiDaS, Depth Anything's relative head; the reply's
        ``larger_is_nearer``) has its value negated, which keeps every comparison the right way round."""
        if DEPTH not in self.client.roles:
            return NO_DEPTH
        height, width = self.pixels.shape[:2]
        x0, y0, x1, y1 = patch_region(patch, height, width)
        whole = self.region_url((0, 0, width, height))
        reply = self.client.request(DEPTH, {"image": whole, "boxes": [[x0, y0, x1, y1]]})
        depths, nearer = reply.get("depths"), reply.get("larger_is_nearer", False)
        if not (isinstance(depths, list) and len(depths) == 1 and is_number(depths[0]) and isinstance(nearer, bool)):
            raise ToolServiceError(f"{DEPTH} tool replied without one finite number in 'depths' (and "
                                   f"'larger_is_nearer' true or false, if at all): {_shown(reply)}")
        return -float(depths[0]) if nearer else float(depths[0])

    def llm_query(self, patch: PatchBox | None, question: str) -> str:
        """The LLM's reply to ``question`` alone (``"unknown"`` without an LLM), whichever patch asks: as in ViperGPT,
        the program puts what it saw into the question itself (``patch.llm_query(f"What city is {name} in?")``
        after a ``simple_query``), so no hidden VQA call adds to its cost or changes the cached prompt."""
        if self.llm is None:
            return UNKNOWN
        return str(self.llm(question))


def _clip(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


def _shown(reply: Any) -> str:
    return repr(reply)[:200]


def _boxes(reply: dict[str, Any]) -> list[tuple[float, float, float, float]]:
    """The reply's boxes, each four finite numbers (an HTTP reply is not trusted to be well formed)."""
    boxes = reply.get("boxes")
    if not isinstance(boxes, list) or not all(isinstance(b, list) and len(b) == 4 and all(is_number(v) for v in b)
                                              for b in boxes):
        raise ToolServiceError(f"{LOC} tool replied without a list of [x0, y0, x1, y1] 'boxes': {_shown(reply)}")
    return [tuple(float(v) for v in box) for box in boxes]  # type: ignore[misc]


def _labels(reply: dict[str, Any], count: int) -> list[str]:
    labels = reply.get("labels")
    if not isinstance(labels, list) or len(labels) != count or not all(isinstance(x, str) for x in labels):
        raise ToolServiceError(f"{CLASSIFY} tool replied without {count} 'labels' (one per image): {_shown(reply)}")
    return labels


@dataclass
class ImageToolsConfig:
    """The model-backed ``ImagePatch`` tools of an environment (see :mod:`clova_train.tools.image_patch`).

    Args:
        loc: LOC (``find``, ``exists``): a prompt-tuned OWL-ViT export directory (``clova-train export``); null: none
            (programs calling ``find`` fail).
        classify: CLASSIFY (``verify_property``): a CLIP export directory; needs ``loc`` (it classifies what LOC
            finds).
        vqa: VQA (``simple_query``): a BLIP VQA export directory; null: ``simple_query`` answers "unknown".
        depth: DEPTH (``compute_depth``): a depth-estimation model directory; null: ``compute_depth`` is 0.0. With
            ``server_url``, only whether it is set matters (the server's own depth model answers).
        server_url: null: load the tools in this process (once per process, shared by its environments); else the
            base URL (``http://host:port``) of a running ``clova-train serve`` of these same exports, which every
            environment process then shares (the export directories are still read here for their endpoint names).
        api_key_env: with ``server_url``: the environment variable holding the server's API key (sent as a bearer
            token when set; ``clova-train serve`` reads the same variable by default).
        labels: the labels CLASSIFY chooses among in ``verify_property`` (an attribute outside them is added for
            that call).
        crop_margin: ``verify_property`` classifies a square around each found object this many times the object's
            longer side (>= 1).
        timeout_s: with ``server_url``: how long one tool request may wait for the server.
        device: where in-process tools run (``cpu``, ``cuda``, ``cuda:1``).
        top_k: in-process tools: ensemble only the ``top_k`` most similar stored prompts (null: each tool's own
            default; a server uses its own setting).
        remembered_answers: answers to repeated requests kept in memory per process (the tools are frozen: the same
            crop asked the same thing gets the same answer; training revisits its tasks); 0: ask every time.
    """

    loc: str | None = None
    classify: str | None = None
    vqa: str | None = None
    depth: str | None = None
    server_url: str | None = None
    api_key_env: str = DEFAULT_API_KEY_ENV
    labels: list[str] = field(default_factory=lambda: list(DEFAULT_LABELS))
    crop_margin: float = 2.0
    timeout_s: float = 30.0
    device: str = "cpu"
    top_k: int | None = None
    remembered_answers: int = 4096

    def problems(self, prefix: str = "") -> list[str]:
        """Every bad value, as ``<prefix>.<field> = <value>: <rule>`` (``prefix``: where this section sits)."""
        found = Problems(prefix)
        local = self.server_url is None
        for role, name in ((LOC, "loc"), (CLASSIFY, "classify"), (VQA, "vqa")):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
                found.need(False, name, value, f"must be the {role} export directory or null")
                continue
            try:
                describe_export(role, value, local=local)
            except ClovaTrainError as err:
                found.need(False, name, value, str(err))
        if self.classify is not None and self.loc is None:
            found.need(False, "classify", self.classify,
                       f"needs {found.key('loc')} too (verify_property classifies the objects LOC finds)")
        if self.depth is not None:
            if not isinstance(self.depth, (str, os.PathLike)) or not str(self.depth).strip():
                found.need(False, "depth", self.depth, "must be the depth model directory or null")
            elif local:
                from clova_train.tools.depth import check_depth_model_dir  # its own module, read when asked for

                try:
                    check_depth_model_dir(self.depth)
                except ClovaTrainError as err:
                    found.need(False, "depth", self.depth, str(err))
        if self.server_url is not None:
            found.need(_is_http_url(self.server_url), "server_url", self.server_url,
                       "must be null (tools in this process) or an http:// or https:// URL of a clova-train serve")
        found.need(isinstance(self.api_key_env, str), "api_key_env", self.api_key_env,
                   "must be the name of an environment variable (empty: no key)")
        found.need(isinstance(self.labels, (list, tuple)) and bool(self.labels)
                   and all(isinstance(x, str) and x.strip() for x in self.labels)
                   and len({x.strip().lower() for x in self.labels}) == len(self.labels),
                   "labels", self.labels, "must be a non-empty list of distinct, non-empty labels")
        found.at_least("crop_margin", self.crop_margin, 1)
        found.positive("timeout_s", self.timeout_s)
        found.need(_is_device(self.device), "device", self.device, "must be a torch device (cpu, cuda, cuda:1, ...)")
        found.need(self.top_k is None or (is_integer(self.top_k) and self.top_k >= 1), "top_k", self.top_k,
                   "must be an integer >= 1 or null")
        found.integer_at_least("remembered_answers", self.remembered_answers, 0)
        return found.messages

    def client_key(self) -> tuple[Any, ...]:
        """The values that choose the client (what :meth:`client` caches it by): the same tools answer alike."""
        def place(value: Any) -> str | None:
            return None if value is None else str(Path(str(value)).expanduser().resolve())

        if self.server_url is not None:
            return ("http", str(self.server_url).rstrip("/"), place(self.loc), place(self.classify), place(self.vqa),
                    self.depth is not None, str(self.api_key_env), repr(self.timeout_s), self.remembered_answers)
        return ("local", place(self.loc), place(self.classify), place(self.vqa), place(self.depth), str(self.device),
                repr(self.top_k), self.remembered_answers)

    def client(self) -> ToolClient:
        """This process's client for these tools: loaded (or connected) on the first call, the same object for every
        later call with equal settings (see the module docstring). A :class:`DataError` lists bad settings."""
        key = (os.getpid(), *self.client_key())  # a forked child loads its own models
        with _CLIENTS_LOCK:
            client = _CLIENTS.get(key)
            if client is None:
                problems = self.problems()
                if problems:
                    raise DataError("bad ImagePatch tool settings: " + "; ".join(problems))
                client = _CLIENTS[key] = self._new_client()
        return client

    def _new_client(self) -> ToolClient:
        client: ToolClient
        if self.server_url is not None:
            client = HttpToolClient.for_exports(self.server_url, self.loc, self.classify, self.vqa, self.depth,
                                                self.api_key_env, self.timeout_s)
        else:
            client = LocalToolClient.load(self.loc, self.classify, self.vqa, self.depth, self.device, self.top_k)
        return MemoizedToolClient(client, self.remembered_answers) if self.remembered_answers else client

    def tools(self, image: str | os.PathLike[str], llm: Callable[[str], str] | None = None) -> ImagePatchTools:
        """The tools of one image on this process's shared client."""
        return ImagePatchTools(image, self.client(), self.labels, self.crop_margin, llm)


_CLIENTS: dict[tuple[Any, ...], ToolClient] = {}
_CLIENTS_LOCK = threading.Lock()  # two threads asking at once must not load the models twice


def close_clients() -> None:
    """Close and forget every client :meth:`ImageToolsConfig.client` made in this process (the next call loads
    again)."""
    with _CLIENTS_LOCK:
        for client in _CLIENTS.values():
            client.close()
        _CLIENTS.clear()


def _is_http_url(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    parsed = urllib.parse.urlsplit(value)
    return parsed.scheme in ("http", "https") and bool(parsed.netloc) and not parsed.query and not parsed.fragment


def _is_device(value: Any) -> bool:
    import torch

    if not isinstance(value, str):
        return False
    try:
        torch.device(value)
    except (RuntimeError, ValueError):
        return False
    return True
