"""AVIS's tools over a benchmark task's image, answered by this package's tool exports instead of the scene oracle.

The information-seeking environments (AVIS, and HAMMR's agents) read each tool's result as one line of text
(:mod:`clova_train.envs.avis.world` lists the lines the offline world writes). On a benchmark's own task files
(``tasks`` in their configs) the same actions run on the task's image through the model-backed ``ImagePatch`` tools
(:class:`~clova_train.tools.image_patch.ImagePatchTools`: LOC, CLASSIFY, VQA exports, in-process or behind one
``clova-train serve``), and write lines of the same shapes:

=============  =================================================  =================================================
action         what runs                                          the line
=============  =================================================  =================================================
caption        VQA on the whole image, asked what it shows        ``caption: <answer>``
vqa            VQA on the whole image, asked the query            ``answer: <answer>``
detect         LOC on the whole image for the query's object      ``detections: <query> at x=<left>, ...`` (left to
                                                                  right) or ``detections: none``
select         LOC for the query's object; the leftmost is kept   ``selected: <query> at x=<left>`` or ``selected:
               as the episode's selection                         nothing``
classify       CLASSIFY on a crop around the selection, among     ``label: <label>`` (``label: unknown`` with no
               the tools' labels                                  selection)
image_search,  the web tools of the config (HTTP); without them,  as the offline world's
text_search    the offline world's knowledge base
=============  =================================================  =================================================

A tool that fails (a server refusing, a model error, an unreadable image) is that action's output ``failed: <why>``,
which the reasoner reads as uninformative; the episode goes on.
"""

from __future__ import annotations

from dataclasses import dataclass

from clova_train.core.errors import ClovaTrainError
from clova_train.envs.avis.seeking_world import DEFAULT_WORLD, SeekingWorld
from clova_train.envs.avis.world import SeekingTools
from clova_train.envs.tasks.records import BenchmarkTask
from clova_train.tools.image_patch import ImagePatchTools

CAPTION_QUESTION = "What is in the image?"
MAX_DETECTIONS_SHOWN = 20  # a detector may return many boxes; the line the reasoner reads stays short


@dataclass(frozen=True)
class Region:
    """A box of the image, pixels with y from the bottom (the ``ImagePatch`` convention)."""

    left: int
    lower: int
    right: int
    upper: int


class ModelSeekingTools:
    """The AVIS actions over one benchmark task (see the module docstring).

    Args:
        task: the task whose image the tools look at.
        image_tools: the model-backed ``ImagePatch`` tools of that image.
        world: the offline world whose knowledge base answers the web tools when the config has no web endpoints.
    """

    def __init__(self, task: BenchmarkTask, image_tools: ImagePatchTools, world: SeekingWorld = DEFAULT_WORLD) -> None:
        self.task, self.image_tools, self.world = task, image_tools, world
        self.selected: Region | None = None

    def run(self, action: str, query: str) -> tuple[str, str]:
        """``(the action's line, "" or why its tool failed)``."""
        try:
            return getattr(self, action)(query), ""
        except ClovaTrainError as err:
            return f"failed: {err}", str(err)

    def _whole(self) -> Region:
        width, height = self.image_tools.size
        return Region(0, 0, width, height)

    def _found(self, query: str) -> tuple[str, list[Region]]:
        name = " ".join(query.split()).strip() or "object"
        boxes = self.image_tools.find(self._whole(), name)
        return name, sorted((Region(*box) for box in boxes), key=lambda r: (r.left, r.lower))

    def caption(self, query: str) -> str:
        return f"caption: {self.image_tools.simple_query(self._whole(), CAPTION_QUESTION)}"

    def vqa(self, query: str) -> str:
        return f"answer: {self.image_tools.simple_query(self._whole(), query)}"

    def detect(self, query: str) -> str:
        name, found = self._found(query)
        if not found:
            return "detections: none"
        shown = ", ".join(f"{name} at x={r.left}" for r in found[:MAX_DETECTIONS_SHOWN])
        more = len(found) - MAX_DETECTIONS_SHOWN
        return f"detections: {shown}" + (f" (and {more} more)" if more > 0 else "")

    def select(self, query: str) -> str:
        name, found = self._found(query)
        self.selected = found[0] if found else None
        return f"selected: {name} at x={found[0].left}" if found else "selected: nothing"

    def classify(self, query: str) -> str:
        if self.selected is None:
            return "label: unknown"
        return f"label: {self.image_tools.label_of(self.selected)}"

    def image_search(self, query: str) -> str:
        return SeekingTools(self.task, self.world).image_search(query)  # type: ignore[arg-type]

    def text_search(self, query: str) -> str:
        return SeekingTools(self.task, self.world).text_search(query)  # type: ignore[arg-type]
