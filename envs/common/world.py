"""The offline visual-reasoning world: scenes of shapes with known answers, and tools that read them.

A task is generated from an integer id (deterministic): a 64x64 scene of 3 to 7 coloured shapes and a
question of one of four types:

* ``count``: "How many red circles are there?" (one step)
* ``exists``: "Is there a blue square?" (one step)
* ``colour``: "What colour is the leftmost triangle?" (one step)
* ``compare``: "Are there more red circles than green squares?" (two steps: count one group, remember the
  number, then count the other and compare)

Task ids fall in three splits (:func:`task_split`): ``train`` (``task_id % 5 != 0``, what training draws),
``val`` (held out, ``(task_id // 5) % 2 == 0``: what a run chooses on: its evaluation callback, ``best_model.zip``,
thresholds) and ``test`` (the other held-out ids: reported once). ``eval``, the name of the held-out split before
there were two, is read as ``test`` (:func:`split_name`). Each question type is asked in its canonical wording
(:data:`QUESTION_TEMPLATES`) unless a world gives it several (``phrasings``): a type with three or more keeps its last
wording for test tasks (:mod:`clova_train.envs.common.wordings`), and the wording is drawn apart from the scene and
the groups, so a task differs between worlds only in its question text.

:class:`SceneTools` answers the sandbox's tool calls from the scene's annotations (an oracle for ``find``,
``exists``, ``verify_property``, ``compute_depth``; ``simple_query`` and ``llm_query`` are weak guessers,
right about a third of the time by default, as a stand-in for asking a model to answer a whole question at once).
A real deployment plugs in model-backed tools with the same methods (see ``clova_train.sandbox.ToolAPI``).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from PIL import Image, ImageDraw

from clova_train.core.errors import DataError
from clova_train.sandbox import PatchRef
from clova_train.synthetic.shapes import COLOURS as RGB

COLOURS = ("red", "green", "blue", "yellow")
SHAPES = ("circle", "square", "triangle")
QUESTION_TYPES = ("count", "exists", "colour", "compare")
QUESTION_TEMPLATES = {  # the canonical wording of each question type
    "count": "How many {c} {s}s are there?",
    "exists": "Is there a {c} {s}?",
    "colour": "What colour is the leftmost {s}?",
    "compare": "Are there more {c} {s}s than {c2} {s2}s?",
}
QUESTION_FIELDS = {"count": ("c", "s"), "exists": ("c", "s"), "colour": ("s",), "compare": ("c", "s", "c2", "s2")}
SIZE = 64
HELD_OUT_MODULUS = 5
SPLITS = ("train", "val", "test")
SPLIT_ALIASES = {"eval": "test"}  # the held-out split's name before it was cut in two (validation and test)
ACCEPTED_SPLITS = (*SPLITS, *SPLIT_ALIASES)
Split = Literal["train", "val", "test", "eval"]  # what an environment config's ``split`` takes
TEST_ONLY_FROM = 3  # a question kind with this many wordings or more keeps its last one for test tasks
WORDING_SEED = 9  # a task's wording is drawn by numpy's generator seeded [task_id, WORDING_SEED]


@dataclass(frozen=True)
class SceneObject:
    """One shape: colour, shape, box ``(left, lower, right, upper)`` (y from the bottom), depth in metres."""

    colour: str
    shape: str
    box: tuple[int, int, int, int]
    depth: float


@dataclass(frozen=True)
class Task:
    """A question about a scene and its gold answer; ``steps`` is how many good instructions it needs."""

    task_id: int
    image_id: str
    objects: tuple[SceneObject, ...]
    question_type: str
    question: str
    answer: str
    groups: tuple[tuple[str, str], ...]  # the (colour, shape) groups the question is about
    steps: int


def is_held_out(task_id: int) -> bool:
    """Whether ``task_id`` is no training task (a validation or a test one)."""
    return task_id % HELD_OUT_MODULUS == 0


def split_name(split: str) -> str:
    """``split`` by its current name (``eval`` -> ``test``); a :class:`DataError` for any other unknown name."""
    split = SPLIT_ALIASES.get(split, split)
    if split not in SPLITS:
        raise DataError(f"split {split!r:.60}: must be one of {', '.join(SPLITS)} (eval is read as test)")
    return split


def task_split(task_id: int) -> str:
    """The split of a task id: ``train``, ``val`` or ``test`` (module docstring); the same on every machine."""
    if not is_held_out(task_id):
        return "train"
    return "val" if (task_id // HELD_OUT_MODULUS) % 2 == 0 else "test"


def task_id_option(options: dict, rng: np.random.Generator, split: str) -> int:
    """The ``task_id`` of ``reset`` options (a non-negative integer), or one drawn from ``split`` when absent."""
    task_id = options.get("task_id")
    if task_id is None:
        return draw_task_id(rng, split)
    if isinstance(task_id, (bool, np.bool_)) or not isinstance(task_id, (int, np.integer)) or task_id < 0:
        raise DataError(f"reset option task_id must be a non-negative integer, got {task_id!r:.60}")
    question = options.get("question")
    if question is not None and not isinstance(question, str):
        raise DataError(f"reset option question must be text, got {type(question).__name__}")
    return int(task_id)


def draw_task_id(rng: np.random.Generator, split: str) -> int:
    """A random task id of ``split`` (``train``, ``val`` or ``test``; ``eval``: ``test``); a generator seeded alike
    draws the same training ids as before the held-out ids were cut in two."""
    wanted = split_name(split)
    while True:
        candidate = int(rng.integers(0, 2**31 - 1))
        if task_split(candidate) == wanted:
            return candidate


def wordings_for_split(wordings: Sequence[str], split: str) -> tuple[str, ...]:
    """The wordings a question of a ``split`` task is asked in: a test task any; a training or validation task not
    the last one of a kind with :data:`TEST_ONLY_FROM` or more."""
    wordings = tuple(wordings)
    return wordings if split == "test" or len(wordings) < TEST_ONLY_FROM else wordings[:-1]


def task_wording(wordings: Sequence[str], task_id: int) -> str:
    """Task ``task_id``'s wording among ``wordings`` (those of its split, drawn by the task id alone)."""
    allowed = wordings_for_split(wordings, task_split(task_id))
    if len(allowed) == 1:
        return allowed[0]
    return allowed[int(np.random.default_rng([task_id, WORDING_SEED]).integers(len(allowed)))]


def _count(objects: tuple[SceneObject, ...], colour: str, shape: str) -> int:
    return sum(o.colour == colour and o.shape == shape for o in objects)


def make_task(task_id: int, kinds: dict[str, float] | None = None,
              phrasings: Mapping[str, Sequence[str]] | None = None) -> Task:
    """The task with this id (same id, same task, on every machine), its question drawn from ``kinds`` (question
    type -> weight; default: the four types alike) and worded in one of ``phrasings``' wordings of its type (default:
    the canonical one; the choice depends on the task's split, :mod:`clova_train.envs.common.wordings`)."""
    rng = np.random.default_rng(task_id)
    objects = []
    for _ in range(int(rng.integers(3, 8))):
        side = int(rng.integers(6, 14))
        left, lower = int(rng.integers(0, SIZE - side)), int(rng.integers(0, SIZE - side))
        objects.append(SceneObject(str(rng.choice(COLOURS)), str(rng.choice(SHAPES)),
                                   (left, lower, left + side, lower + side), round(float(rng.uniform(1, 10)), 2)))
    objects_t = tuple(objects)
    if kinds is None or (set(kinds) == set(QUESTION_TYPES) and len(set(kinds.values())) == 1):
        kind = QUESTION_TYPES[int(rng.integers(len(QUESTION_TYPES)))]
    else:
        names = [k for k in QUESTION_TYPES if kinds.get(k, 0) > 0]
        weights = np.array([kinds[k] for k in names], dtype=float)
        kind = names[int(rng.choice(len(names), p=weights / weights.sum()))]
    present = [(o.colour, o.shape) for o in objects_t]

    def group() -> tuple[str, str]:  # half the time a group in the scene, else any
        if rng.random() < 0.5:
            return present[int(rng.integers(len(present)))]
        return str(rng.choice(COLOURS)), str(rng.choice(SHAPES))

    if kind == "count":
        c, s = group()
        answer, groups, steps, fields = str(_count(objects_t, c, s)), ((c, s),), 1, {"c": c, "s": s}
    elif kind == "exists":
        c, s = group()
        answer = "yes" if _count(objects_t, c, s) else "no"
        groups, steps, fields = ((c, s),), 1, {"c": c, "s": s}
    elif kind == "colour":
        s = present[int(rng.integers(len(present)))][1]
        leftmost = min((o for o in objects_t if o.shape == s), key=lambda o: o.box[0])
        answer, groups, steps, fields = leftmost.colour, (("", s),), 1, {"s": s}
    else:
        (c1, s1), (c2, s2) = group(), group()
        while (c2, s2) == (c1, s1):
            c2, s2 = str(rng.choice(COLOURS)), str(rng.choice(SHAPES))
        answer = "yes" if _count(objects_t, c1, s1) > _count(objects_t, c2, s2) else "no"
        groups, steps, fields = ((c1, s1), (c2, s2)), 2, {"c": c1, "s": s1, "c2": c2, "s2": s2}
    template = task_wording((phrasings or {}).get(kind) or (QUESTION_TEMPLATES[kind],), task_id)
    return Task(task_id, f"scene-{task_id}", objects_t, kind, template.format(**fields), answer, groups, steps)


def draw_scene(task: Task, scale: int = 1, background: tuple[int, int, int] = (128, 128, 128)) -> Image.Image:
    """The task's scene as an RGB picture ``scale`` times the world's size: its shapes in task order (a later one
    covers an earlier one), boxes turned from the world's y-from-the-bottom to the picture's y-from-the-top."""
    image = Image.new("RGB", (SIZE * scale, SIZE * scale), background)
    draw = ImageDraw.Draw(image)
    for obj in task.objects:
        left, lower, right, upper = obj.box
        box = (left * scale, (SIZE - upper) * scale, right * scale, (SIZE - lower) * scale)
        if obj.shape == "circle":
            draw.ellipse(box, fill=RGB[obj.colour])
        elif obj.shape == "square":
            draw.rectangle(box, fill=RGB[obj.colour])
        else:
            draw.polygon([((box[0] + box[2]) / 2, box[1]), (box[2], box[3]), (box[0], box[3])], fill=RGB[obj.colour])
    return image


def normalise_answer(answer: object) -> str:
    text = str(answer).strip().lower().rstrip(".")
    return {"true": "yes", "false": "no"}.get(text, text)


_NAME = re.compile(r"^(?:(?P<colour>red|green|blue|yellow)\s+)?(?P<shape>circle|square|triangle)s?$")


def _inside(box: tuple[int, int, int, int], patch: PatchRef) -> bool:
    cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    return patch.left <= cx <= patch.right and patch.lower <= cy <= patch.upper


class SceneTools:
    """Tool API over the annotations of one task's scene (see module docstring).

    Args:
        task: the task whose scene the tools read.
        guess_right_one_in: ``simple_query`` / ``llm_query`` give the gold answer for one question in this many.
    """

    def __init__(self, task: Task, guess_right_one_in: int = 3) -> None:
        self.task = task
        self.guess_right_one_in = guess_right_one_in

    def _matching(self, patch: PatchRef, object_name: str) -> list[SceneObject]:
        match = _NAME.match(object_name.strip().lower())
        if match is None:
            return []
        colour, shape = match.group("colour"), match.group("shape")
        found = [o for o in self.task.objects if o.shape == shape and (colour is None or o.colour == colour)
                 and _inside(o.box, patch)]
        return sorted(found, key=lambda o: o.box[0])

    def find(self, patch: PatchRef, object_name: str) -> list[tuple[int, int, int, int]]:
        return [o.box for o in self._matching(patch, object_name)]

    def exists(self, patch: PatchRef, object_name: str) -> bool:
        return bool(self._matching(patch, object_name))

    def verify_property(self, patch: PatchRef, object_name: str, attribute: str) -> bool:
        return any(o.colour == attribute.strip().lower() for o in self._matching(patch, object_name))

    def compute_depth(self, patch: PatchRef) -> float:
        inside = [o.depth for o in self.task.objects if _inside(o.box, patch)]
        return float(np.median(inside)) if inside else 10.0

    def _guess(self, question: str) -> str:
        h = zlib.crc32(f"{self.task.task_id}:{question}".encode())
        if h % self.guess_right_one_in == 0:
            return self.task.answer
        options = {"count": [str(n) for n in range(5)], "exists": ["yes", "no"], "compare": ["yes", "no"],
                   "colour": list(COLOURS)}[self.task.question_type]
        wrong = [o for o in options if o != self.task.answer]
        return wrong[(h >> 4) % len(wrong)]

    def simple_query(self, patch: PatchRef, question: str) -> str:
        return self._guess(question)

    def llm_query(self, patch: PatchRef | None, question: str) -> str:
        return self._guess(question)
