"""Reading the visual-reasoning benchmarks' task files in their own formats.

* ``vqav2`` / ``okvqa``: the questions file (``{"questions": [{"question_id", "image_id", "question"}], "data_subtype"}``)
  and the annotations file (``{"annotations": [{"question_id", "answers": [{"answer"}...], "answer_type"}]}``);
  images ``COCO_<data_subtype>_<image_id:012d>.jpg`` (or COCO 2017's ``<image_id:012d>.jpg``).
* ``aokvqa``: one JSON list per split (``question_id``, ``image_id``, ``question``, ``choices``,
  ``correct_choice_idx``, ``direct_answers``); images ``<image_id:012d>.jpg`` (COCO 2017).
* ``gqa``: the balanced questions JSON, an object keyed by question id (``imageId``, ``question``, ``answer``);
  images ``<imageId>.jpg``. Read as a stream (``ijson``), entry by entry: the 1.4 GB training file needs the memory
  of its tasks only, and ``limit`` stops reading.
* ``refcoco`` / ``refcoco+`` / ``refcocog``: the referring expressions (a JSON list, or the distributed ``refs(*).p``
  pickle, read with an unpickler that resolves no global at all: plain containers and scalars only) of ``ref_id``,
  ``ann_id``, ``image_id``, ``split`` and ``sentences``, and COCO's ``instances.json`` for the boxes and file names.

Every file goes through the package's safe readers; a malformed record is one :class:`DataError` naming the file and
the record. Records that are well formed but unusable (no image on disk, no answers, as in a test split, a box outside
its image) are skipped and counted (:class:`SkippedRecords`), or refused with ``missing_images="error"``.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clova_train.core.errors import DataError
from clova_train.core.safe_files import iter_json_object, printable, read_bytes, read_json
from clova_train.core.safe_pickle import AllowlistUnpickler
from clova_train.envs.tasks.metrics import METRICS
from clova_train.envs.tasks.records import BenchmarkTask, SkippedRecords

VQA_FORMATS = ("vqav2", "okvqa")
REFERRING_FORMATS = ("refcoco", "refcoco+", "refcocog")
FORMATS = (*VQA_FORMATS, "aokvqa", "gqa", *REFERRING_FORMATS)
ANSWER_TYPE_ALIASES = {"yes/no": "yes/no", "number": "number", "other": "other"}


@dataclass(frozen=True)
class TaskFiles:
    """Where a benchmark's tasks are, in its own files.

    Args:
        format: one of ``vqav2``, ``okvqa``, ``aokvqa``, ``gqa``, ``refcoco``, ``refcoco+``, ``refcocog``.
        questions: the questions file (VQAv2 / OK-VQA questions JSON, the A-OKVQA split JSON, GQA's balanced
            questions JSON, or the RefCOCO refs JSON / ``refs(*).p``).
        images: the folder of the benchmark's images.
        annotations: VQAv2 / OK-VQA: the annotations JSON; RefCOCO: COCO's ``instances.json``; else unused.
        split: keep only records of this split (RefCOCO's ``train`` / ``val`` / ``testA`` / ``testB``; a record's own
            ``split`` field elsewhere); None keeps all. Train and evaluate on different files or splits.
        limit: stop after this many usable tasks (None: all).
        missing_images: ``skip`` (count and leave out a record whose image is not on disk) or ``error``.
        metric: the metric scoring these tasks, a name of ``clova_train.envs.tasks.metrics.METRICS`` (``vqav2``,
            ``okvqa``, ``aokvqa``, ``aokvqa-mc``, ``gqa``, ``refcoco``: IoU, ``refcoco@0.5``: accuracy at IoU >= 0.5,
            ...); None: the format's own (VQA accuracy, A-OKVQA direct answer, GQA exact match, RefCOCO IoU).
    """

    format: str
    questions: str
    images: str
    annotations: str | None = None
    split: str | None = None
    limit: int | None = None
    missing_images: str = "skip"
    metric: str | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise DataError(f"unknown task format {self.format!r} (known: {', '.join(FORMATS)})")
        if self.missing_images not in ("skip", "error"):
            raise DataError(f"missing_images must be 'skip' or 'error', got {self.missing_images!r}")
        needs_annotations = self.format in VQA_FORMATS or self.format in REFERRING_FORMATS
        if needs_annotations and not self.annotations:
            raise DataError(f"task format {self.format!r} needs an annotations file (questions and answers, or COCO "
                            "instances for the boxes, are in two files)")
        if self.limit is not None and self.limit < 1:
            raise DataError(f"limit must be at least 1, got {self.limit}")
        if self.metric is not None and self.metric not in METRICS:
            raise DataError(f"unknown metric {self.metric!r} (known: {', '.join(METRICS)})")
        grounding_metric = self.metric_name.split("@")[0] in REFERRING_FORMATS
        if grounding_metric != (self.format in REFERRING_FORMATS) or (
                self.metric == "aokvqa-mc" and self.format != "aokvqa"):
            raise DataError(f"metric {self.metric!r} cannot score {self.format} tasks (a box metric scores referring "
                            "expressions, aokvqa-mc A-OKVQA's choices, the others text answers)")

    @property
    def metric_name(self) -> str:
        """The metric that scores these tasks: ``metric``, or the format's own."""
        return self.metric or self.format


def load_tasks(files: TaskFiles) -> tuple[list[BenchmarkTask], SkippedRecords]:
    """The usable tasks of ``files`` in file order (at most ``files.limit``) and what was skipped."""
    skipped = SkippedRecords()
    reader = _READERS[files.format]
    tasks: list[BenchmarkTask] = []
    for task in reader(files, skipped):
        if not task.image.is_file():
            if files.missing_images == "error":
                raise DataError(f"{files.format} task {task.task_id}: its image {printable(task.image)} is missing")
            skipped.add("image missing", f"{task.task_id} ({printable(task.image)})")
            continue
        tasks.append(task)
        if files.limit is not None and len(tasks) >= files.limit:
            break
    if not tasks:
        raise DataError(f"{printable(files.questions)} gave no usable {files.format} task"
                        + (f" of split {files.split!r}" if files.split else "")
                        + (f": {skipped.summary()}" if skipped.total else ""))
    return tasks, skipped


# ---------------------------------------------------------------------------------------------- checking records
class _Record:
    """One record of a task file: typed field access whose errors name the file and the record."""

    def __init__(self, value: Any, where: str) -> None:
        if not isinstance(value, dict):
            raise DataError(f"{where} must be an object, got {type(value).__name__}")
        self.value, self.where = value, where

    def get(self, key: str, kind: type | tuple[type, ...], required: bool = True) -> Any:
        found = self.value.get(key)
        if found is None and not required:
            return None
        if isinstance(found, bool) or not isinstance(found, kind):
            names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            state = "is missing" if key not in self.value else f"is a {type(found).__name__}"
            raise DataError(f"{self.where}: {key!r} {state}, it must be a {names}")
        return found

    def strings(self, key: str, required: bool = True) -> tuple[str, ...] | None:
        found = self.get(key, list, required)
        if found is None:
            return None
        if not all(isinstance(item, str) for item in found):
            raise DataError(f"{self.where}: {key!r} must be a list of strings")
        return tuple(found)


def _list_in(document: Any, key: str, where: str) -> list[Any]:
    found = document.get(key) if isinstance(document, dict) else None
    if not isinstance(found, list):
        raise DataError(f"{where} must be an object with a {key!r} list")
    return found


def _answer_type(answers: tuple[str, ...]) -> str:
    """``yes/no`` or ``number`` when every answer is one, else ``other`` (formats without an answer type)."""
    if answers and all(a.strip().lower() in ("yes", "no") for a in answers):
        return "yes/no"
    if answers and all(a.strip().isdigit() for a in answers):
        return "number"
    return "other"


def _in_split(record: _Record, split: str | None) -> bool:
    return split is None or record.get("split", str, required=False) in (None, split)


# ---------------------------------------------------------------------------------------------- the formats
def _vqa(files: TaskFiles, skipped: SkippedRecords) -> Iterator[BenchmarkTask]:
    questions_where = f"{files.format} questions {printable(files.questions)}"
    questions = read_json(files.questions, f"{files.format} questions")
    subtype = questions.get("data_subtype") if isinstance(questions, dict) else None
    annotations_where = f"{files.format} annotations {printable(files.annotations)}"
    by_id: dict[int, _Record] = {}
    for index, value in enumerate(_list_in(read_json(files.annotations, f"{files.format} annotations"),
                                           "annotations", annotations_where)):
        record = _Record(value, f"{annotations_where} record {index}")
        by_id[record.get("question_id", int)] = record
    images = Path(files.images)
    for index, value in enumerate(_list_in(questions, "questions", questions_where)):
        record = _Record(value, f"{questions_where} record {index}")
        question_id, image_id = record.get("question_id", int), record.get("image_id", int)
        question = record.get("question", str)
        annotation = by_id.get(question_id)
        if annotation is None:
            skipped.add("no annotation for the question", str(question_id))
            continue
        answers = []
        for k, answer in enumerate(annotation.get("answers", list)):
            answers.append(_Record(answer, f"{annotation.where} answer {k}").get("answer", str))
        if not answers:
            skipped.add("no answers", str(question_id))
            continue
        kind = annotation.get("answer_type", str, required=False)
        name = f"COCO_{subtype}_{image_id:012d}.jpg" if isinstance(subtype, str) else f"{image_id:012d}.jpg"
        image = images / name
        if not image.is_file() and (images / f"{image_id:012d}.jpg").is_file():
            image = images / f"{image_id:012d}.jpg"  # the same COCO image under its 2017 name
        yield BenchmarkTask(str(question_id), files.format, image, question, tuple(answers),
                            ANSWER_TYPE_ALIASES.get(kind or "", _answer_type(tuple(answers))))


def _aokvqa(files: TaskFiles, skipped: SkippedRecords) -> Iterator[BenchmarkTask]:
    where = f"aokvqa file {printable(files.questions)}"
    records = read_json(files.questions, "aokvqa file")
    if not isinstance(records, list):
        raise DataError(f"{where} must be a JSON list of questions")
    for index, value in enumerate(records):
        record = _Record(value, f"{where} record {index}")
        if not _in_split(record, files.split):
            continue
        question_id = str(record.get("question_id", (str, int)))
        choices = record.strings("choices") or ()
        answers = record.strings("direct_answers", required=False)
        correct = record.get("correct_choice_idx", int, required=False)
        if correct is not None and not 0 <= correct < len(choices):
            raise DataError(f"{record.where}: correct_choice_idx {correct} is not an index of its "
                            f"{len(choices)} choices")
        if not answers and correct is None:
            skipped.add("no answers (a test split?)", question_id)
            continue
        image = Path(files.images) / f"{record.get('image_id', int):012d}.jpg"
        yield BenchmarkTask(question_id, "aokvqa", image, record.get("question", str), answers or (),
                            _answer_type(answers or ()), choices, correct)


def _gqa(files: TaskFiles, skipped: SkippedRecords) -> Iterator[BenchmarkTask]:
    where = f"gqa questions {printable(files.questions)}"
    # streamed: GQA's balanced training questions are 1.4 GB, more than a whole-file read holds
    for question_id, value in iter_json_object(files.questions, "gqa questions"):
        record = _Record(value, f"{where} question {question_id}")
        answer = record.get("answer", str, required=False)
        if answer is None:
            skipped.add("no answer (a test or submission file?)", question_id)
            continue
        image = Path(files.images) / f"{record.get('imageId', str)}.jpg"
        yield BenchmarkTask(question_id, "gqa", image, record.get("question", str), (answer,), _answer_type((answer,)))


def _read_refs(path: str) -> Any:
    """RefCOCO's refs: JSON, or the distributed pickle with no global resolvable (plain containers only)."""
    if not path.endswith((".p", ".pkl", ".pickle")):
        return read_json(path, "refcoco refs")
    data = read_bytes(path, "refcoco refs")
    try:
        return AllowlistUnpickler(io.BytesIO(data), allowed=()).load()
    except (pickle.UnpicklingError, EOFError, UnicodeDecodeError, ValueError, TypeError, IndexError) as err:
        raise DataError(f"refcoco refs {printable(path)} is not a pickle of plain lists and dicts: {err}") from None


def _referring(files: TaskFiles, skipped: SkippedRecords) -> Iterator[BenchmarkTask]:
    where = f"{files.format} refs {printable(files.questions)}"
    refs = _read_refs(files.questions)
    if not isinstance(refs, list):
        raise DataError(f"{where} must be a list of referring expressions")
    instances_where = f"COCO instances {printable(files.annotations)}"
    instances = read_json(files.annotations, "COCO instances")
    images: dict[int, _Record] = {}
    for index, value in enumerate(_list_in(instances, "images", instances_where)):
        record = _Record(value, f"{instances_where} image {index}")
        images[record.get("id", int)] = record
    boxes: dict[int, list[Any]] = {}
    for index, value in enumerate(_list_in(instances, "annotations", instances_where)):
        record = _Record(value, f"{instances_where} annotation {index}")
        boxes[record.get("id", int)] = record.get("bbox", list)
    for index, value in enumerate(refs):
        record = _Record(value, f"{where} record {index}")
        if not _in_split(record, files.split):
            continue
        ref_id, ann_id, image_id = record.get("ref_id", int), record.get("ann_id", int), record.get("image_id", int)
        image, box = images.get(image_id), boxes.get(ann_id)
        if image is None or box is None:
            raise DataError(f"{record.where}: its {'image' if image is None else 'annotation'} "
                            f"{image_id if image is None else ann_id} is not in {instances_where}")
        if len(box) != 4 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in box):
            raise DataError(f"{instances_where} annotation {ann_id}: bbox must be four numbers [x, y, width, height]")
        width, height = image.get("width", int), image.get("height", int)
        x, y, w, h = (float(v) for v in box)
        if w <= 0 or h <= 0 or x < 0 or y < 0 or x + w > width + 1 or y + h > height + 1:
            skipped.add("box outside its image or empty", f"ref {ref_id}")
            continue
        for k, sentence in enumerate(record.get("sentences", list)):
            text = _Record(sentence, f"{record.where} sentence {k}").get("sent", str)
            yield BenchmarkTask(f"{ref_id}:{k}", files.format, Path(files.images) / image.get("file_name", str), text,
                                answer_type="box", box=(x, y, w, h), image_size=(width, height))


_READERS: dict[str, Callable[[TaskFiles, SkippedRecords], Iterator[BenchmarkTask]]] = {
    **{name: _vqa for name in VQA_FORMATS}, "aokvqa": _aokvqa, "gqa": _gqa,
    **{name: _referring for name in REFERRING_FORMATS},
}
