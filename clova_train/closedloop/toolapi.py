"""The tool API a loop program calls, backed by this package's prompt tools and their pools.

:class:`VisualTools` implements the sandbox's :class:`~clova_train.sandbox.ToolAPI` for one task:
``find`` / ``exists`` ask a :class:`Locator` (LOC: :class:`ServerLocator`, OWL-ViT behind its server with its
pool, or the offline world's annotations), ``verify_property`` crops each found object and asks CLASSIFY (a
:class:`~clova_train.tools.prompt_server.PromptToolServer` of CLIP: the serving code, with its prompt pool and
ensemble) which of the labels it shows, ``simple_query`` asks the VQA server when there is one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from clova_train.closedloop.tasks import LoopTask
from clova_train.sandbox import PatchRef
from clova_train.tools.images import load_image_uint8
from clova_train.tools.prompt_server import PromptToolServer

Box = tuple[int, int, int, int]


def crop_box(box: Box, height: int, width: int, margin: float) -> tuple[int, int, int, int]:
    """Pixel rows and columns ``(x0, y0, x1, y1)`` (top-down, end-exclusive) of the square crop around ``box``
    (``(left, lower, right, upper)``, y from the bottom) whose side is ``margin`` times the box's longer side."""
    left, lower, right, upper = box
    side = max(right - left, upper - lower) * margin
    cx, cy = (left + right) / 2, height - (lower + upper) / 2
    x0, y0 = int(max(0, cx - side / 2)), int(max(0, cy - side / 2))
    x1, y1 = int(min(width, cx + side / 2)), int(min(height, cy + side / 2))
    return x0, y0, max(x1, x0 + 1), max(y1, y0 + 1)



def to_input_size(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``[N, 3, h, w]`` images in [0, 1] resized (bicubic, antialiased) to a tool's input ``size``: how the loop
    hands CLASSIFY both its crops and the pool check's held-out images."""
    resized = F.interpolate(images, size=size, mode="bicubic", antialias=True, align_corners=False)
    return resized.clamp(0, 1)


class Locator(Protocol):
    """LOC for the loop: boxes ``(left, lower, right, upper)`` (y from the bottom) of ``object_name`` in ``patch``."""

    def find(self, task: LoopTask, patch: PatchRef, object_name: str) -> list[Box]: ...


class Captioner(Protocol):
    """Turns a task's image into text for reflection (CLOVA uses BLIP captions)."""

    def caption(self, task: LoopTask) -> str: ...


def _region(image: torch.Tensor, patch: PatchRef) -> tuple[torch.Tensor, int, int]:
    """The patch's pixels of a ``[3, H, W]`` image, and the patch's (left, top) offset in top-down rows."""
    height = image.shape[1]
    top, bottom = max(0, height - patch.upper), min(height, height - patch.lower)
    left, right = max(0, patch.left), min(image.shape[2], patch.right)
    return image[:, top:max(bottom, top + 1), left:max(right, left + 1)], left, top


class VqaCaptioner:
    """Captions by asking the VQA server what the image shows (a stand-in for BLIP's captioning head).

    Args:
        server: the VQA server.
        question: what it is asked.
    """

    def __init__(self, server: PromptToolServer, question: str = "what does the picture show?") -> None:
        self.server, self.question = server, question

    def caption(self, task: LoopTask) -> str:
        with torch.no_grad():
            return self.server.answer([load_image_uint8(task.image)], [self.question])[0]


class ServerLocator:
    """LOC from a prompt-tuned OWL-ViT server (its ``detect`` with the concept's pool prompts).

    Args:
        server: the LOC server.
    """

    def __init__(self, server: PromptToolServer) -> None:
        self.server = server

    def find(self, task: LoopTask, patch: PatchRef, object_name: str) -> list[Box]:
        image = load_image_uint8(task.image)
        region, left, top = _region(image, patch)
        height = image.shape[1]
        with torch.no_grad():
            found = self.server.detect([region], object_name.strip())[0]["boxes"]
        # detector boxes are (x0, y0, x1, y1) in the region's top-down pixels; the API's have y from the bottom
        return [(int(left + x0), int(height - (top + y1)), int(left + x1), int(height - (top + y0))) for x0, y0, x1, y1 in found]


class VisualTools:
    """ToolAPI of one task (see the module docstring).

    Args:
        task: the task whose image the program looks at.
        locator: LOC.
        classify: CLIP with its current prompt pool (CLASSIFY).
        labels: the labels CLASSIFY chooses among; an attribute outside them is added for that call.
        crop_margin: crops around a found box are this many times the box's side (context for the classifier).
        vqa: a prompt-tuned BLIP server for ``simple_query`` (without one it answers "unknown").
    """

    def __init__(self, task: LoopTask, locator: Locator, classify: PromptToolServer, labels: Sequence[str],
                 crop_margin: float = 2.0, vqa: PromptToolServer | None = None) -> None:
        self.task, self.locator, self.classify, self.labels = task, locator, classify, list(labels)
        self.crop_margin, self.vqa = crop_margin, vqa
        self._image: torch.Tensor | None = None

    @property
    def image(self) -> torch.Tensor:
        if self._image is None:
            self._image = load_image_uint8(self.task.image).float() / 255.0
        return self._image

    def crop(self, box: Box) -> torch.Tensor:
        """A square crop around ``box``, resized to the classifier's input size."""
        _, height, width = self.image.shape
        x0, y0, x1, y1 = crop_box(box, height, width, self.crop_margin)
        return to_input_size(self.image[:, y0:y1, x0:x1].unsqueeze(0), self.classify.tool.image_size)

    def find(self, patch: PatchRef, object_name: str) -> list[Box]:
        return self.locator.find(self.task, patch, object_name)

    def exists(self, patch: PatchRef, object_name: str) -> bool:
        return bool(self.find(patch, object_name))

    def verify_property(self, patch: PatchRef, object_name: str, attribute: str) -> bool:
        boxes = self.find(patch, object_name)
        if not boxes:
            return False
        attribute = attribute.strip().lower()
        labels = self.labels if attribute in self.labels else [*self.labels, attribute]
        with torch.no_grad():
            predicted, _ = self.classify.classify(torch.cat([self.crop(b) for b in boxes]), labels)
        return attribute in predicted

    def simple_query(self, patch: PatchRef, question: str) -> str:
        if self.vqa is None:
            return "unknown"
        region, _, _ = _region(load_image_uint8(self.task.image), patch)
        with torch.no_grad():
            return self.vqa.answer([region], [question])[0]

    def compute_depth(self, patch: PatchRef) -> float:
        return 0.0

    def llm_query(self, patch: PatchRef | None, question: str) -> str:
        return "unknown"
