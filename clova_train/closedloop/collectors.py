"""Data collection for the learning phase: one collector per kind of tool, each writing what the tool's
datamodule reads, so every fit can be rerun alone from the folder it names.

* :class:`ImageCollector` (SELECT, CLASSIFY, REPLACE): images of the concept from an :class:`ImageSource` (a
  local folder tree, :class:`FolderImageSource`, or an HTTP image-search endpoint, :class:`HttpImageSource`)
  and a few of every other label as negatives, in the concept-folder layout
  (``<concept>/train``, ``<concept>/val``) that ``ConceptFolderDataModule`` reads.
* :class:`GroundingCollector` (LOC, SEG): the images of a COCO / LVIS file that hold the concept, with all
  their annotations, as a smaller annotation file that ``GroundingDataModule`` reads.
* :class:`VqaCollector` (VQA): the LLM infers what the VQA tool should have answered to the failed step's
  question; the region and that answer become a records file for ``VqaRecordsDataModule``, validated on the
  original question.

Each successive collection for the same (tool, concept) takes the next images of the source, so a concept
flagged again is trained on new data. A source with nothing (left) for a concept gives a :class:`Collected` with
``skipped`` set: recorded and reported by the loop, never an exception. A source that cannot be reached raises
:class:`SourceUnavailable`, which pauses the loop like a failing LLM backend.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from PIL import Image

from clova_train.closedloop.inference import Trace
from clova_train.closedloop.reflection import Templates
from clova_train.closedloop.tasks import LoopTask
from clova_train.core.atomic import write_atomic, write_text_atomic
from clova_train.core.errors import DataError
from clova_train.core.safe_files import parse_json
from clova_train.llm.backends import BackendError, ChatBackend, ask
from clova_train.tools.images import list_images

class SourceUnavailable(BackendError):
    """An image source could not be reached or answered badly (the loop pauses; rerunning continues)."""


@dataclass
class CollectionRequest:
    """What reflection asks for: data for ``tool`` about ``concept``; ``index`` counts earlier collections of it."""

    tool: str
    concept: str
    index: int
    task: LoopTask
    trace: Trace
    step: int | None = None
    caption: str = ""


@dataclass
class Collected:
    """What a collector wrote: the folder, how many items, the fit's data arguments, or why it skipped."""

    tool: str
    concept: str
    directory: str
    items: int = 0
    fit_arguments: dict[str, Any] = field(default_factory=dict)
    skipped: str = ""
    data_hash: str = ""


def folder_hash(directory: Path) -> str:
    """SHA-256 over every file's relative path and bytes: the identity of collected data."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(directory)).encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


class Collector(Protocol):
    """Collects training data for one tool kind into ``directory``."""

    def collect(self, request: CollectionRequest, directory: Path) -> Collected: ...


class ImageSource(Protocol):
    """Images of a concept: ``count`` encoded images starting at ``offset`` (fewer, or none, when it has no more)."""

    def search(self, concept: str, count: int, offset: int) -> list[bytes]: ...


def concept_folder(concept: str) -> str:
    """The folder name of a concept in the concept-folder layout ("red circle" -> "red_circle")."""
    return concept.strip().replace(" ", "_")


class FolderImageSource:
    """Images under ``root/<concept>/`` (sorted by name): the default, offline, image source.

    Args:
        root: folder with one sub-folder of images per concept.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise DataError(f"image source folder not found: {self.root}")

    def search(self, concept: str, count: int, offset: int) -> list[bytes]:
        folder = self.root / concept_folder(concept)
        if not folder.is_dir():
            return []
        return [p.read_bytes() for p in list_images(folder)[offset:offset + count]]


class HttpImageSource:
    """An image-search endpoint: ``GET <url>?q=<concept>&count=<n>&offset=<k>`` answering
    ``{"images": ["<base64 PNG or JPEG>", ...]}``. Replies are checked (JSON, size, decodable images) before use.

    Args:
        url: the endpoint.
        timeout_s: seconds per request.
        max_reply_bytes: larger replies are refused.
    """

    def __init__(self, url: str, timeout_s: float = 30.0, max_reply_bytes: int = 64 << 20) -> None:
        self.url, self.timeout_s, self.max_reply_bytes = url, timeout_s, max_reply_bytes

    def search(self, concept: str, count: int, offset: int) -> list[bytes]:
        query = urllib.parse.urlencode({"q": concept, "count": count, "offset": offset})
        try:
            with urllib.request.urlopen(f"{self.url}?{query}", timeout=self.timeout_s) as reply:  # noqa: S310 (configured URL)
                body = reply.read(self.max_reply_bytes + 1)
        except OSError as err:
            raise SourceUnavailable(f"image source {self.url} failed for {concept!r}: {err}") from None
        if len(body) > self.max_reply_bytes:
            raise SourceUnavailable(f"image source {self.url} replied with more than {self.max_reply_bytes} bytes")
        try:
            images = parse_json(body, "the reply")["images"]
            decoded = [base64.b64decode(item, validate=True) for item in images]
        except (DataError, ValueError, KeyError, TypeError) as err:
            raise SourceUnavailable(f"image source {self.url} gave a malformed reply for {concept!r}: {err}") from None
        return decoded[:count]


def _check_image(data: bytes, where: str) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
        return image.convert("RGB")
    except Exception as err:  # noqa: BLE001  (any decoder failure means: not an image)
        raise DataError(f"{where}: not a readable image ({type(err).__name__})") from None


class ImageCollector:
    """SELECT / CLASSIFY / REPLACE data from an image source (see the module docstring).

    Args:
        source: where images come from.
        labels: every label the tool chooses among; the others than the concept give negatives.
        train_images: images of the concept to train on per collection (one prompt each).
        val_images: further images of the concept for the gate (never trained on).
        negatives_per_label: train and val images of each other label (the same ones every time).
    """

    def __init__(self, source: ImageSource, labels: list[str], train_images: int = 8, val_images: int = 4,
                 negatives_per_label: int = 3) -> None:
        self.source, self.labels = source, labels
        self.train_images, self.val_images, self.negatives_per_label = train_images, val_images, negatives_per_label

    @staticmethod
    def _write(folder: Path, images: list[bytes], where: str, prefix: str = "", start: int = 0) -> None:
        # File names carry the collection number: instance ids ("<concept>/<file>") stay unique across
        # collections, so merged pools keep every collection's prompts.
        folder.mkdir(parents=True, exist_ok=True)
        for k, data in enumerate(images):
            _check_image(data, f"{where} image {start + k}").save(folder / f"{prefix}{start + k:03d}.png")

    def collect(self, request: CollectionRequest, directory: Path) -> Collected:
        per_collection = self.train_images + self.val_images
        found = self.source.search(request.concept, per_collection, request.index * per_collection)
        if len(found) < 2:
            have = "no images" if not found else "one image"
            return Collected(request.tool, request.concept, str(directory),
                             skipped=f"the image source has {have} (left) of {request.concept!r}")
        val = max(1, min(self.val_images, len(found) - 1))  # a short last batch still trains on one
        name = concept_folder(request.concept)
        prefix = f"c{request.index:02d}-"
        self._write(directory / name / "val", found[:val], f"source {request.concept!r}", prefix)
        self._write(directory / name / "train", found[val:], f"source {request.concept!r}", prefix, val)
        negatives = 0
        for label in self.labels:
            if concept_folder(label) == name:
                continue
            images = self.source.search(label, 2 * self.negatives_per_label, 0)
            if len(images) < 2:
                continue
            half = len(images) // 2
            self._write(directory / concept_folder(label) / "train", images[:half], f"source {label!r}")
            self._write(directory / concept_folder(label) / "val", images[half:], f"source {label!r}", "", half)
            negatives += 1
        if not negatives:
            return Collected(request.tool, request.concept, str(directory),
                             skipped="the image source has no images of any other label to use as negatives")
        return Collected(request.tool, request.concept, str(directory), len(found) - val,
                         {"data.init_args.root": str(directory), "data.init_args.concepts": [name]},
                         data_hash=folder_hash(directory))


class GroundingCollector:
    """LOC / SEG data: the concept's images from a COCO or LVIS annotation file (see the module docstring).

    Args:
        annotations: the COCO / LVIS JSON file.
        image_root: folder of its images (default: ``images/`` beside it, else its folder).
        images_per_collection: images of the concept per collection (the paper takes 200 for LOC, 50 for SEG).
    """

    def __init__(self, annotations: str | Path, image_root: str | Path | None = None, images_per_collection: int = 50) -> None:
        from clova_train.tools.grounding.coco import GroundingAnnotations

        self.annotations = GroundingAnnotations(annotations, image_root)
        self.images_per_collection = images_per_collection

    def collect(self, request: CollectionRequest, directory: Path) -> Collected:
        coco = self.annotations.coco
        wanted = request.concept.strip().lower()
        categories = [c for c in coco.dataset.get("categories", []) if str(c.get("name", "")).lower() == wanted]
        if not categories:
            return Collected(request.tool, request.concept, str(directory),
                             skipped=f"{self.annotations.path} has no category named {request.concept!r}")
        image_ids = sorted(coco.getImgIds(catIds=[categories[0]["id"]]))
        start = request.index * self.images_per_collection
        chosen = image_ids[start:start + self.images_per_collection]
        if not chosen:
            return Collected(request.tool, request.concept, str(directory),
                             skipped=f"{self.annotations.path} has no images (left) of {request.concept!r}")
        images = []
        for image_id in chosen:
            info = dict(coco.imgs[image_id])
            info["file_name"] = str(self.annotations.image_file(image_id).resolve())
            images.append(info)
        subset = {"images": images, "annotations": coco.loadAnns(coco.getAnnIds(imgIds=chosen)),
                  "categories": coco.dataset.get("categories", [])}
        path = directory / "annotations.json"
        write_text_atomic(path, json.dumps(subset))
        return Collected(request.tool, request.concept, str(directory), len(chosen),
                         {"data.init_args.annotations": str(path), "data.init_args.concept": categories[0]["name"]},
                         data_hash=folder_hash(directory))


class VqaCollector:
    """VQA data inferred by the LLM (see the module docstring).

    Args:
        llm: the chat backend that infers the answer.
        templates: holds the ``vqa_answer`` prompt.
    """

    def __init__(self, llm: ChatBackend, templates: Templates) -> None:
        self.llm, self.templates = llm, templates

    def collect(self, request: CollectionRequest, directory: Path) -> Collected:
        calls = [(i, c) for i, c in enumerate(request.trace.calls, 1) if c.tool == "VQA"]
        if request.step is not None:
            calls = [(i, c) for i, c in calls if i == request.step] or calls
        if not calls:
            return Collected(request.tool, request.concept, str(directory), skipped="the program asked VQA nothing")
        index, call = calls[-1]
        question = str(call.arguments[0]) if call.arguments else ""
        prompt = self.templates.render("vqa_answer", instruction=request.task.instruction, caption=request.caption,
                                       feedback=request.task.feedback, steps=request.trace.steps_text(),
                                       question=question, tool_answer=call.result)
        answer = ask(self.llm, [{"role": "user", "content": prompt}]).strip().splitlines()
        answer_text = answer[0].strip() if answer else ""
        if not answer_text or not question:
            return Collected(request.tool, request.concept, str(directory), skipped="the LLM inferred no answer")
        directory.mkdir(parents=True, exist_ok=True)
        with Image.open(request.task.image) as image:
            rgb = image.convert("RGB")
            height = rgb.height
            if call.patch and len(call.patch) == 4:
                left, lower, right, upper = call.patch
                rgb = rgb.crop((left, height - upper, right, height - lower))
            write_atomic(directory / "region.png", lambda tmp: rgb.save(tmp, format="PNG"))
        record = {"id": f"{request.task.task_id}:step{index}", "image": "region.png", "question": question,
                  "answer": answer_text, "val_question": question, "val_answer": answer_text}
        path = directory / "records.json"
        write_text_atomic(path, json.dumps([record], indent=1))
        return Collected(request.tool, request.concept, str(directory), 1, {"data.init_args.records": str(path)},
                         data_hash=folder_hash(directory))
