"""The offline information-seeking world of the AVIS and HAMMR environments.

Scenes are the shape scenes of :mod:`clova_train.envs.common.world` (same task id, same scene). Each (colour, shape)
is the emblem of a guild with a founding year: a small knowledge base that only web-style tools reach. A task
asks one of five kinds of question; each kind has its own good path through the tools:

=========  =====================================================  ====================================
kind       question                                               good path
=========  =====================================================  ====================================
count      How many red circles are there?                        detect
exists     Is there a blue square?                                vqa (or detect)
colour     What colour is the leftmost triangle?                  detect, select, classify
entity     Which guild has the leftmost square as its emblem?     detect, select, image_search
fact       In which year was the guild with the leftmost ...      detect, select, image_search, text_search
=========  =====================================================  ====================================

:class:`SeekingTools` answers tool calls from the scene and the knowledge base; each returns one line of text
that the reasoner reads. ``caption`` never says enough (useless everywhere); ``vqa`` on the whole image is
right for existence and otherwise a guesser, right once in the world's ``guess_right_one_in`` (3) questions (on
knowledge questions it names a guild or a year all the same, as VQA models hallucinate; harmful: the reasoner takes
it as the answer);
``select``, ``classify``, ``image_search`` and ``text_search`` need what earlier steps found (a detection, a
crop, a guild name), which the working memory passes to them as the query. Which questions are asked and how they
are worded is the world file's (:mod:`clova_train.envs.avis.seeking_world`).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from clova_train.envs.avis.seeking_world import COLOURED, DEFAULT_WORLD, SEEKING_KINDS, SeekingWorld
from clova_train.envs.common.world import COLOURS, SHAPES, SceneObject, Task, make_task, task_id_option

GUILD_WORDS = {"red": "crimson", "green": "verdant", "blue": "azure", "yellow": "golden",
               "circle": "wheel", "square": "tower", "triangle": "arrow"}
NO_RESULT = "no results"


def guild(colour: str, shape: str) -> str:
    """The guild whose emblem is a ``colour`` ``shape`` (lower case, as answers are compared)."""
    return f"the {GUILD_WORDS[colour]} {GUILD_WORDS[shape]} guild"


def founded(colour: str, shape: str) -> str:
    return str(1500 + zlib.crc32(f"{colour} {shape}".encode()) % 400)


GUILDS = {guild(c, s): (c, s) for c in COLOURS for s in SHAPES}
WEB_PREFIXES = {"image_search": "similar images", "text_search": "web"}  # how each search tool's line starts


def knowledge_base() -> dict[str, dict[str, str]]:
    """The world's knowledge base as a knowledge file holds it (:mod:`clova_train.llm.knowledge_server`): each
    search's answer, without the tool's prefix (:data:`WEB_PREFIXES`), for every query the offline tools know."""
    return {"image_search": {f"{c} {s}": f"emblem of {name}" for name, (c, s) in GUILDS.items()},
            "text_search": {name: f"{name} was founded in {founded(c, s)}" for name, (c, s) in GUILDS.items()}}


def write_knowledge_file(path: str | Path) -> Path:
    """Write :func:`knowledge_base` to ``path`` as JSON (to serve with ``python -m
    clova_train.llm.knowledge_server``); served, ``image_search`` and ``text_search`` answer as the offline tools."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(knowledge_base(), indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return path


def leftmost(objects: tuple[SceneObject, ...], shape: str) -> SceneObject | None:
    matching = [o for o in objects if o.shape == shape]
    return min(matching, key=lambda o: o.box[0]) if matching else None


def gold_answer(objects: tuple[SceneObject, ...], kind: str, groups: dict[str, str]) -> str:
    c, s = groups.get("c", ""), groups["s"]
    if kind == "count":
        return str(sum(o.colour == c and o.shape == s for o in objects))
    if kind == "exists":
        return "yes" if any(o.colour == c and o.shape == s for o in objects) else "no"
    target = leftmost(objects, s)
    if target is None:
        return "none"
    return {"colour": target.colour, "entity": guild(target.colour, target.shape),
            "fact": founded(target.colour, target.shape)}[kind]


def make_seeking_task(task_id: int, question: str | None = None, kinds: tuple[str, ...] = SEEKING_KINDS,
                      world: SeekingWorld = DEFAULT_WORLD) -> Task:
    """The task with this id: the scene of ``world.make_task(task_id)`` and a question of one of ``kinds``
    in one of ``world``'s wordings (or ``question`` itself, e.g. a sub-question an agent passes to another)."""
    scene = make_task(task_id)
    objects = scene.objects
    if question is None:
        rng = np.random.default_rng([task_id, 7])
        kind = world.draw_kind(rng, kinds)
        present = [(o.colour, o.shape) for o in objects]
        c, s = present[int(rng.integers(len(present)))]
        if kind in COLOURED and rng.random() < 0.5:  # half the time any group, present or not
            c, s = str(rng.choice(COLOURS)), str(rng.choice(SHAPES))
        question = world.phrase(kind, task_id, **({"c": c, "s": s} if kind in COLOURED else {"s": s}))
    parsed = world.parse(question)
    if parsed is None:
        raise ValueError(f"not a question of the information-seeking world {world.name}: {question!r}")
    kind, groups = parsed
    return Task(task_id, scene.image_id, objects, kind, question, gold_answer(objects, kind, groups),
                ((groups.get("c", ""), groups["s"]),), len(GOOD_PATHS[kind]))


def check_kinds(kinds: tuple[str, ...], world: SeekingWorld = DEFAULT_WORLD) -> None:
    """Raise ``ValueError`` unless ``kinds`` is a non-empty selection of :data:`SEEKING_KINDS` of which ``world``
    asks at least one."""
    if not kinds or any(k not in SEEKING_KINDS for k in kinds):
        raise ValueError(f"kinds {list(kinds)!r}: each must be one of {', '.join(SEEKING_KINDS)}")
    if not any(world.questions.get(k, 0) > 0 for k in kinds):
        raise ValueError(f"kinds {list(kinds)!r}: the world {world.name} gives none of them a question weight above 0")


def task_from_options(options: dict, rng: np.random.Generator, split: str, kinds: tuple[str, ...],
                      world: SeekingWorld = DEFAULT_WORLD) -> Task:
    """The task of an episode from ``reset`` options: ``task`` given whole (an agent calling another), else
    ``task_id`` (or one drawn from ``split``) with an optional ``question``."""
    if isinstance(options.get("task"), Task):
        return options["task"]
    return make_seeking_task(task_id_option(options, rng, split), options.get("question"), kinds, world)


GOOD_PATHS: dict[str, tuple[str, ...]] = {
    "count": ("detect",), "exists": ("vqa",), "colour": ("detect", "select", "classify"),
    "entity": ("detect", "select", "image_search"), "fact": ("detect", "select", "image_search", "text_search"),
}


@dataclass
class SeekingTools:
    """The tools of the information-seeking world over one task (see the module docstring)."""

    task: Task
    world: SeekingWorld = DEFAULT_WORLD

    def _guess(self, query: str) -> str:
        h = zlib.crc32(f"{self.task.task_id}:{query}".encode())
        if h % self.world.guess_right_one_in == 0:
            return self.task.answer
        options = {"count": [str(n) for n in range(5)], "colour": list(COLOURS), "exists": ["yes", "no"],
                   "entity": sorted(GUILDS), "fact": sorted({founded(c, s) for c, s in GUILDS.values()})}[
            self.task.question_type]
        wrong = [o for o in options if o != self.task.answer]
        return wrong[(h >> 4) % len(wrong)]

    def caption(self, query: str) -> str:
        return f"caption: an image of {len(self.task.objects)} coloured shapes"

    def vqa(self, query: str) -> str:
        parsed = self.world.parse(query)
        if parsed and parsed[0] == "exists":
            return f"answer: {gold_answer(self.task.objects, 'exists', parsed[1])}"
        return f"answer: {self._guess(query)}"

    def detect(self, query: str) -> str:
        found = sorted(self.task.objects, key=lambda o: o.box[0])
        return "detections: " + ", ".join(f"{o.colour} {o.shape} at x={o.box[0]}" for o in found)

    def select(self, query: str) -> str:
        """``query``: a shape; the leftmost detected one is cropped."""
        shape = query.strip().lower().rstrip("s")
        target = leftmost(self.task.objects, shape) if shape in SHAPES else None
        return f"selected: {target.colour} {target.shape} at x={target.box[0]}" if target else "selected: nothing"

    def classify(self, query: str) -> str:
        """``query``: the selected object (``colour shape``); CLASSIFY names its colour."""
        words = query.strip().lower().split()
        return f"colour: {words[0]}" if len(words) == 2 and words[0] in COLOURS else "colour: unknown"

    def image_search(self, query: str) -> str:
        """``query``: the selected object; similar images are captioned with the guild it is the emblem of."""
        words = query.strip().lower().split()
        if len(words) == 2 and words[0] in COLOURS and words[1] in SHAPES:
            return f"{WEB_PREFIXES['image_search']}: emblem of {guild(words[0], words[1])}"
        return f"{WEB_PREFIXES['image_search']}: {NO_RESULT}"

    def text_search(self, query: str) -> str:
        """``query``: a guild name; anything else finds nothing."""
        key = query.strip().lower()
        if key in GUILDS:
            return f"{WEB_PREFIXES['text_search']}: {key} was founded in {founded(*GUILDS[key])}"
        return f"{WEB_PREFIXES['text_search']}: {NO_RESULT}"
