"""Prompt-tuned CLIP behind the reasoning loop's ``verify_property``: this package's tools serving the agent.

:class:`ClipPromptTools` implements the sandbox's tool API. ``verify_property(object, attribute)`` crops the
objects that ``locate`` finds and asks a :class:`~clova_train.tools.prompt_server.PromptToolServer` (CLASSIFY with the
prompt pool learned by ``PromptTuning`` with the CLIP tool) which of ``attributes`` each crop shows; every other call
(``find``, ``exists``, ``compute_depth``, queries) goes to ``locate``, a detector-like tool API. In the
offline world ``locate`` is the annotation oracle and the image is rendered from the scene, so CLIP is the
only model in the loop:

    env = ReasoningLoopEnv(config, tools_factory=clip_tools_factory(PromptToolServer.from_export(path), COLOURS))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from clova_train.sandbox import PatchRef, ToolAPI
from clova_train.tools.prompt_server import PromptToolServer
from clova_train.envs.common.world import SceneTools, Task, draw_scene


def render_task(task: Task, background: tuple[int, int, int] = (128, 128, 128)) -> torch.Tensor:
    """The task's scene as a ``[3, SIZE, SIZE]`` float image in [0, 1] (boxes have y from the bottom)."""
    image = draw_scene(task, background=background)
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)


class ClipPromptTools:
    """Tool API whose ``verify_property`` is prompt-tuned CLIP's CLASSIFY over ``attributes``.

    Args:
        server: the CLIP prompt server (an export of a CLIP prompt-tuning run).
        image: ``[3, H, W]`` image in [0, 1], y of boxes measured from the bottom.
        locate: tool API for everything else (detection, depth, queries).
        attributes: the candidate labels CLASSIFY chooses among (e.g. the colours).
    """

    def __init__(self, server: PromptToolServer, image: torch.Tensor, locate: ToolAPI,
                 attributes: Sequence[str]) -> None:
        self.server, self.image, self.locate, self.attributes = server, image, locate, list(attributes)
        self.classifications = 0

    def _crops(self, boxes: list[tuple[int, int, int, int]]) -> torch.Tensor:
        height = self.image.shape[1]
        size = self.server.tool.image_size
        crops = [self.image[:, height - upper:height - lower, left:right].unsqueeze(0)
                 for left, lower, right, upper in boxes]
        return torch.cat([F.interpolate(c, size=size, mode="bilinear", align_corners=False) for c in crops])

    def verify_property(self, patch: PatchRef, object_name: str, attribute: str) -> bool:
        boxes = self.locate.find(patch, object_name)
        if not boxes:
            return False
        labels = self.attributes if attribute in self.attributes else [*self.attributes, attribute]
        with torch.no_grad():
            predicted, _ = self.server.classify(self._crops(boxes), labels)
        self.classifications += len(boxes)
        return attribute in predicted

    def find(self, patch: PatchRef, object_name: str) -> list[tuple[int, int, int, int]]:
        return self.locate.find(patch, object_name)

    def exists(self, patch: PatchRef, object_name: str) -> bool:
        return self.locate.exists(patch, object_name)

    def simple_query(self, patch: PatchRef, question: str) -> str:
        return self.locate.simple_query(patch, question)

    def compute_depth(self, patch: PatchRef) -> float:
        return self.locate.compute_depth(patch)

    def llm_query(self, patch: PatchRef | None, question: str) -> str:
        return self.locate.llm_query(patch, question)


def clip_tools_factory(server: PromptToolServer, attributes: Sequence[str]) -> Callable[[Task], ClipPromptTools]:
    """A ``tools_factory`` for :class:`~clova_train.envs.ReasoningLoopEnv`: CLIP on the rendered scene."""
    return lambda task: ClipPromptTools(server, render_task(task), SceneTools(task), attributes)
