"""A small offline benchmark in the real benchmarks' file formats, rendered from the shapes world's scenes.

:func:`write_offline_benchmark` renders each task of :func:`~clova_train.envs.common.world.make_task` as a COCO-named
JPEG and writes its question in GQA's format (training ids), OK-VQA's (held-out ids: ten annotator answers, the
answer type of its question), or either set in the other format, and its objects as RefCOCO referring expressions
("the red circle", for objects no other shape of the scene shares colour and shape with; ``train`` and ``val`` splits
by the world's held-out rule), so the readers of :mod:`clova_train.envs.tasks.formats` run on it as on the downloaded
files: by default train on the GQA set, evaluate on the OK-VQA one, as HYDRA's Table 4 trains on one dataset and tests
on another.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from clova_train.core.atomic import write_json_atomic
from clova_train.envs.common.world import COLOURS, SIZE, SceneObject, Task, draw_scene, is_held_out, make_task
from clova_train.envs.tasks.formats import TaskFiles

ANSWER_TYPES = {"count": "number", "exists": "yes/no", "compare": "yes/no", "colour": "other"}
GQA_STRUCTURE = {"count": "query", "exists": "verify", "compare": "compare", "colour": "query"}
ANSWERS_PER_QUESTION = 10  # VQA and OK-VQA collect ten answers per question
SUBTYPE = "val2014"
TRAIN_SUBTYPE = "train2014"  # an OK-VQA-format training set's COCO split
SET_FORMATS = ("gqa", "okvqa")
GQA_FILES = {"train": "train_balanced_questions.json", "eval": "testdev_balanced_questions.json"}


def image_name(task_id: int, subtype: str = SUBTYPE) -> str:
    """The COCO 2014 file name of the task's scene (OK-VQA's naming; GQA's ``imageId`` is this without ``.jpg``)."""
    return f"COCO_{subtype}_{task_id:012d}.jpg"


def pixel_box(obj: SceneObject, scale: int) -> tuple[float, float, float, float]:
    """The object's COCO box ``[x, y, width, height]`` in image pixels (y from the top; the world's is from the
    bottom)."""
    left, lower, right, upper = obj.box
    return (float(left * scale), float((SIZE - upper) * scale), float((right - left) * scale),
            float((upper - lower) * scale))


def _unique_objects(task: Task) -> list[tuple[int, SceneObject]]:
    kinds = [(o.colour, o.shape) for o in task.objects]
    return [(k, o) for k, o in enumerate(task.objects) if kinds.count((o.colour, o.shape)) == 1]


def _write_gqa(root: Path, split: str, ids: list[int], tasks: dict[int, Task], names: dict[int, str],
               images: str) -> TaskFiles:
    records = {str(i): {"imageId": names[i][:-4], "question": tasks[i].question, "answer": tasks[i].answer,
                        "types": {"structural": GQA_STRUCTURE[tasks[i].question_type], "semantic": "attr",
                                  "detailed": tasks[i].question_type}} for i in ids}
    path = root / "gqa" / GQA_FILES[split]
    write_json_atomic(path, records)
    return TaskFiles("gqa", str(path), images)


def _write_okvqa(root: Path, subtype: str, ids: list[int], tasks: dict[int, Task], images: str) -> TaskFiles:
    questions = {"data_subtype": subtype, "questions": [
        {"image_id": i, "question": tasks[i].question, "question_id": i} for i in ids]}
    annotations = {"annotations": [
        {"image_id": i, "question_id": i, "question_type": tasks[i].question_type,
         "answer_type": ANSWER_TYPES[tasks[i].question_type],
         "answers": [{"answer": tasks[i].answer, "answer_confidence": "yes", "answer_id": k + 1}
                     for k in range(ANSWERS_PER_QUESTION)]} for i in ids]}
    questions_path = root / "okvqa" / f"OpenEnded_mscoco_{subtype}_questions.json"
    annotations_path = root / "okvqa" / f"mscoco_{subtype}_annotations.json"
    write_json_atomic(questions_path, questions)
    write_json_atomic(annotations_path, annotations)
    return TaskFiles("okvqa", str(questions_path), images, str(annotations_path))


def write_offline_benchmark(root: str | Path, train_ids: Iterable[int], eval_ids: Iterable[int],
                            scale: int = 4, train_format: str = "gqa",
                            eval_format: str = "okvqa") -> dict[str, TaskFiles]:
    """Write the images and the ``train_format`` (``train_ids``), ``eval_format`` (``eval_ids``) and RefCOCO (both,
    split by the world's held-out rule) files under ``root``; the :class:`TaskFiles` that read each set, keyed
    ``<format>-train``, ``<format>-eval``, ``refcoco-train`` and ``refcoco-val``.

    A set's format is ``gqa`` (``gqa/train_balanced_questions.json`` or ``gqa/testdev_balanced_questions.json``) or
    ``okvqa`` (``okvqa/OpenEnded_mscoco_<subtype>_questions.json`` and ``okvqa/mscoco_<subtype>_annotations.json``,
    subtype ``train2014`` for the training set, ``val2014`` for the evaluation set). The images are in ``images/``,
    COCO-named: ``COCO_val2014_<id>.jpg``, except an OK-VQA training set's, ``COCO_train2014_<id>.jpg`` (as its
    questions file's ``data_subtype`` names them).

    Ids must not repeat across the two sets; a training id must not be held out and an evaluation id must be, so the
    sets are the world's own split."""
    root = Path(root)
    train, evaluation = [int(i) for i in train_ids], [int(i) for i in eval_ids]
    for name, chosen in (("train_format", train_format), ("eval_format", eval_format)):
        if chosen not in SET_FORMATS:
            raise ValueError(f"{name} must be one of {', '.join(SET_FORMATS)}, got {chosen!r}")
    if set(train) & set(evaluation):
        raise ValueError("a task id is in both the training and the evaluation set")
    if any(is_held_out(i) for i in train) or not all(is_held_out(i) for i in evaluation):
        raise ValueError("training ids must be the world's training tasks and evaluation ids its held-out ones")
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    tasks = {i: make_task(i) for i in (*train, *evaluation)}
    train_subtype = TRAIN_SUBTYPE if train_format == "okvqa" else SUBTYPE
    names = {i: image_name(i, train_subtype if i in train else SUBTYPE) for i in tasks}
    for task_id, task in tasks.items():
        draw_scene(task, scale).save(images / names[task_id], quality=95)

    images_dir = str(images)
    files: dict[str, TaskFiles] = {}
    for split, chosen, ids, subtype in (("train", train_format, train, train_subtype),
                                        ("eval", eval_format, evaluation, SUBTYPE)):
        files[f"{chosen}-{split}"] = (_write_gqa(root, split, ids, tasks, names, images_dir) if chosen == "gqa" else
                                      _write_okvqa(root, subtype, ids, tasks, images_dir))

    refs, instances = [], {"images": [], "annotations": [], "categories": [
        {"id": k + 1, "name": colour} for k, colour in enumerate(COLOURS)]}
    for task_id, task in tasks.items():
        instances["images"].append({"id": task_id, "file_name": names[task_id], "width": SIZE * scale,
                                    "height": SIZE * scale})
        for k, obj in _unique_objects(task):
            ann_id = task_id * 100 + k
            instances["annotations"].append({"id": ann_id, "image_id": task_id, "bbox": list(pixel_box(obj, scale)),
                                             "category_id": COLOURS.index(obj.colour) + 1})
            refs.append({"ref_id": ann_id, "ann_id": ann_id, "image_id": task_id, "file_name": names[task_id],
                         "split": "val" if is_held_out(task_id) else "train",
                         "sentences": [{"sent": f"the {obj.colour} {obj.shape}"}]})
    (root / "refcoco").mkdir(exist_ok=True)
    write_json_atomic(root / "refcoco" / "refs.json", refs)
    write_json_atomic(root / "refcoco" / "instances.json", instances)

    return {
        **files,
        "refcoco-train": TaskFiles("refcoco", str(root / "refcoco" / "refs.json"), images_dir,
                                   str(root / "refcoco" / "instances.json"), split="train"),
        "refcoco-val": TaskFiles("refcoco", str(root / "refcoco" / "refs.json"), images_dir,
                                 str(root / "refcoco" / "instances.json"), split="val"),
    }

