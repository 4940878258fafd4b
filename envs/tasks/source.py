"""Episodes of a reasoning-loop environment drawn from a benchmark's own task files instead of the offline world.

``tasks`` in an environment config (:class:`BenchmarkTasksConfig`) names the files training draws from (``train``),
the files a run chooses on (``val``: its evaluation callback, ``best_model.zip``, thresholds) and the files it is
reported on once (``test``; ``eval`` is its old name, still read): two datasets when a controller trained on one
benchmark is tested on another (HYDRA Table 4: trained on GQA, tested on OK-VQA), or splits of one. Without ``val``
files, the ``test`` files are cut in two by question id (:func:`held_out_half`: the CRC-32 of the id, even:
validation, odd: test), the same way on every machine, so no task is both chosen on and reported. Each file set is
read once per process (:func:`benchmark_tasks`) and shared by every environment of the process. The ``ImagePatch`` tools of an
episode are model-backed (``tools``: LOC / CLASSIFY / VQA exports and a depth model, in-process or behind one
``clova-train serve``; :mod:`clova_train.tools.image_patch`).

Which task an episode plays: training draws one at random (the environment's seeded generator); validation and
test, reset with a seed ``s``, play task ``s mod n`` of their ``n``, so the episodes of seeds ``0 .. n-1`` play every
task of the split once, in file order, and every policy compared on the same seeds sees the same tasks.

A final answer is scored by the tasks' metric (:mod:`clova_train.envs.tasks.metrics`; Eq. 3's ``m``), and is related
or not by the answer type of the question. A grounding task's answer is a box: an ``ImagePatch`` (or the
``(left, lower, right, upper)`` tuple ``find`` returns, y from the bottom) is turned into the benchmark's COCO
``[x, y, width, height]`` (y from the top) before it is scored.
"""

from __future__ import annotations

import functools
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clova_train.core.checks import Problems
from clova_train.core.errors import DataError
from clova_train.envs.common.world import SPLIT_ALIASES, SPLITS, split_name
from clova_train.envs.tasks.formats import TaskFiles, load_tasks
from clova_train.envs.tasks.metrics import as_box, eq3_answer_terms
from clova_train.envs.tasks.records import BenchmarkTask, SkippedRecords
from clova_train.sandbox import PatchRef
from clova_train.tools.image_patch import ImageToolsConfig
from clova_train.tools.images import image_size



def task_files(value: TaskFiles | dict[str, Any] | None, where: str) -> TaskFiles | None:
    """``value`` as :class:`TaskFiles` (a YAML / ``gymnasium.make`` dict is converted; its error names ``where``)."""
    if value is None or isinstance(value, TaskFiles):
        return value
    if not isinstance(value, dict):
        raise DataError(f"{where} must be a mapping of task-file settings (format, questions, images, ...)")
    try:
        return TaskFiles(**value)
    except TypeError as err:
        raise DataError(f"{where}: {err}") from None
    except DataError as err:
        raise DataError(f"{where}: {err}") from None


def held_out_half(task_id: str) -> str:
    """``val`` or ``test``: the half of the ``test`` files a task belongs to when no ``val`` files are given (the
    CRC-32 of its question id, even: ``val``)."""
    return "val" if zlib.crc32(str(task_id).encode("utf-8", "surrogatepass")) % 2 == 0 else "test"


@dataclass(frozen=True)
class SplitTasks:
    """The tasks an environment of one split plays: its files, the usable tasks (the split's half of the ``test``
    files when validation has no files of its own), what was skipped, and how messages name them."""

    files: TaskFiles
    tasks: tuple[BenchmarkTask, ...]
    skipped: SkippedRecords
    where: str


@dataclass
class BenchmarkTasksConfig:
    """Episodes from a benchmark's own files (see :mod:`clova_train.envs.tasks.source`).

    Args:
        train: the task files training draws from (with no task files at all, the environment plays its offline
            world) (``format``, ``questions``, ``images``, ``annotations``, ``split``, ``limit``, ``metric``; see
            ``clova_train.envs.tasks.formats.TaskFiles``).
        val: the task files a run chooses on (evaluation during training, ``best_model.zip``); null: the validation
            half of the ``test`` files (module docstring).
        test: the task files the final table reports; another benchmark than ``train`` to test transfer (HYDRA
            Table 4).
        eval: the old name of ``test`` (read as ``test``; giving both is an error).
        tools: the model-backed ``ImagePatch`` tools (LOC / CLASSIFY / VQA exports, a depth model; in-process, or
            a running ``clova-train serve`` of them shared by every environment process).
    """

    train: TaskFiles | None = None
    val: TaskFiles | None = None
    test: TaskFiles | None = None
    eval: TaskFiles | None = None
    tools: ImageToolsConfig = field(default_factory=ImageToolsConfig)

    def __post_init__(self) -> None:
        self.train = task_files(self.train, "tasks.train")
        self.val = task_files(self.val, "tasks.val")
        self.test = task_files(self.test, "tasks.test")
        if self.eval is not None:
            if self.test is not None:
                raise DataError("tasks: give the test files once, as tasks.test (tasks.eval is its old name)")
            self.test, self.eval = task_files(self.eval, "tasks.eval"), None
        if isinstance(self.tools, dict):
            self.tools = ImageToolsConfig(**self.tools)

    @property
    def given(self) -> bool:
        """Whether task files are given at all (without any, the environment plays its offline world)."""
        return any(files is not None for files in (self.train, self.val, self.test))

    def _own_files(self, split: str) -> TaskFiles | None:
        return {"train": self.train, "val": self.val, "test": self.test}[split]

    def halves_test_files(self) -> bool:
        """Whether validation and test share the ``test`` files, each playing its half (no ``val`` files)."""
        return self.val is None

    def files(self, split: str) -> TaskFiles:
        """The files of ``split`` (``train``, ``val`` or ``test``; ``eval``: ``test``; ``val`` without files of its
        own: the ``test`` files); a :class:`DataError` when the config has none."""
        split = split_name(split)
        files = self._own_files(split)
        if files is None and split == "val":
            files = self.test
        if files is None:
            more = " (nor tasks.test, whose validation half it would play)" if split == "val" else ""
            raise DataError(f"tasks.{split}: no task files for the {split} split{more}")
        return files

    def split_tasks(self, split: str) -> SplitTasks:
        """The tasks an environment of ``split`` plays (module docstring), read once per process."""
        split = split_name(split)
        files = self.files(split)
        tasks, skipped = benchmark_tasks(files)
        where = f"tasks.{split} ({files.questions})"
        if split != "train" and self.halves_test_files():
            tasks = tuple(task for task in tasks if held_out_half(task.task_id) == split)
            where = f"the {split} half of tasks.test ({files.questions})"
            if not tasks:
                raise DataError(f"{where}: no task falls in this half; give more test tasks or tasks.val")
        return SplitTasks(files, tasks, skipped, where)

    def problems(self, split: str, prefix: str = "") -> list[str]:
        """What stops an environment of ``split`` from running on these tasks: no files for ``split``, a file or
        folder of any split that is not there, the tools' settings."""
        found = Problems(prefix)
        split = SPLIT_ALIASES.get(split, split)
        needed = {"train": "train", "val": "val" if self.val is not None else "test", "test": "test"}.get(split)
        for name in SPLITS:
            files = self._own_files(name)
            if files is None:
                if name == needed:
                    found.add(f"{found.key(name)}: give the task files of the {name} split (format, questions, "
                              "images, ...)")
                continue
            for key in ("questions", "annotations"):
                path = getattr(files, key)
                if path is not None and not Path(path).is_file():
                    found.add(f"{found.key(name)}.{key} = {path}: file not found")
            if not Path(files.images).is_dir():
                found.add(f"{found.key(name)}.images = {files.images}: folder not found")
        return [*found.messages, *self.tools.problems(found.key("tools"))]


@functools.lru_cache(maxsize=8)
def benchmark_tasks(files: TaskFiles) -> tuple[tuple[BenchmarkTask, ...], SkippedRecords]:
    """The usable tasks of ``files`` and what was skipped, read once per process for every environment."""
    tasks, skipped = load_tasks(files)
    return tuple(tasks), skipped


def episode_index(count: int, split: str, seed: int | None, draw: Any) -> int:
    """Which of ``count`` tasks an episode plays (module docstring): ``seed mod count`` for a seeded reset of a
    held-out split (``val``, ``test``), else ``draw(count)`` (the environment's generator)."""
    if split != "train" and seed is not None:
        return seed % count
    return int(draw(count))


def task_by_id(tasks: tuple[BenchmarkTask, ...], task_id: object, where: str) -> BenchmarkTask:
    """The task whose benchmark id is ``task_id`` (``reset(options={"task_id": ...})``)."""
    wanted = str(task_id)
    for task in tasks:
        if task.task_id == wanted:
            return task
    raise DataError(f"reset option task_id {wanted[:60]!r} is not a task of {where}")


def image_dimensions(task: BenchmarkTask) -> tuple[int, int]:
    """``(width, height)`` of the task's image: from the annotations when they give it, else the image header."""
    return task.image_size or image_size(task.image)


def as_benchmark_answer(value: object, task: BenchmarkTask, height: int) -> object:
    """A program's ``final_answer`` in the benchmark's terms: a COCO box for a grounding task (from an ``ImagePatch``
    or a ``(left, lower, right, upper)`` box, y from the bottom), the value itself otherwise."""
    if task.answer_type != "box":
        return value
    if isinstance(value, PatchRef):
        left, lower, right, upper = value.left, value.lower, value.right, value.upper
    else:
        box = as_box(value)  # four finite numbers (read as left, lower, right, upper here)
        if box is None:
            return value
        left, lower, right, upper = box
    return (float(left), float(height - upper), float(right - left), float(upper - lower))


def score_answer(files: TaskFiles, task: BenchmarkTask, answer: object) -> tuple[bool, float]:
    """``(related, m)`` of Eq. 3 for ``answer`` (already in the benchmark's terms) under the files' metric."""
    return eq3_answer_terms(files.metric_name, answer, task)


def gold_text(task: BenchmarkTask) -> str:
    """What ``info["gold"]`` shows: the most common ground-truth answer, the right choice, or the box."""
    if task.answer_type == "box":
        return str(list(task.box or ()))
    if task.correct_choice is not None and task.choices:
        return task.choices[task.correct_choice]
    return Counter(task.answers).most_common(1)[0][0] if task.answers else ""
