"""The offline world of the AVIS and HAMMR environments, described by a file: which questions are asked, how they
are worded, how the guessing tools behave.

``avis.world`` / ``hammr.world`` names a shipped preset (``envs/worlds/seeking/<name>.yaml``: ``seeking``, the
default, ``seeking-paraphrased`` and ``seeking-delayed``) or a YAML/JSON file of this form (every key optional; the defaults are the
``seeking`` world)::

    name: my-world
    questions: {count: 1, exists: 1, colour: 1, entity: 1, fact: 1}   # question kinds drawn, with weights
    phrasings:              # per kind, the wordings users ask in ({c}: a colour, {s}: a shape); one is drawn per
      fact:                 # task. The first is the kind's canonical wording (the one agents ask each other).
        - "In which year was the guild with the leftmost {s} as its emblem founded?"
        - "When did the guild whose emblem is the leftmost {s} start?"
    tools:
      guess_right_one_in: 3  # vqa on anything but an existence question guesses: the gold answer once in k
      call_costs: {image_search: 1.0, "agent:web": 2.0}  # subtracted from the reward when called (default 0)
      requires: {text_search: caption}  # answers only once memory holds a result of that tool (default: none)

Costs and requirements make worlds where the first useful call earns nothing now: with ``requires: {text_search:
caption}`` a caption (useless by itself, labelled uninformative) must be in the working memory before the web
search answers; until then the search says ``no results (needs a caption result first)``, which the reasoner
labels uninformative and the scripted planner reads as an LLM would (it calls the missing tool when the graph
lets it). A per-call cost (a tool name, or ``agent:<name>`` for an agent of HAMMR or AVIS) is subtracted from the
step's reward whenever that action runs.

How the planner and the dispatcher mislead follows from the wordings: the offline LLM of AVIS and HAMMR
(:mod:`clova_train.envs.avis.scripted`) understands every wording of the world, as an LLM would, but chooses tools
and agents by the in-context example most like the question in words. (A nested ``hydra`` agent runs HYDRA's own
scripted planner, which knows only the canonical wordings.) A wording far from its kind's example and
close to another's is routed the wrong way; a learner that reads the question can learn the right way.

The scenes, the knowledge base and the tools' answers are the world's fixed vocabulary
(:mod:`clova_train.envs.avis.world`). Loading checks every value and names the file and key at fault: a wording
with another placeholder than ``{c}`` / ``{s}``, one a kind's answer cannot use, or one that reads as another
kind's question is refused. Nothing in the file is run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from clova_train.core.errors import DataError
from clova_train.envs.common.wordings import check_unambiguous, read_phrasings, wording_pattern
from clova_train.envs.common.world import COLOURS, SHAPES, task_wording, wordings_for_split
from clova_train.core.checks import is_number
from clova_train.envs.common.world_file import (
    guess_right_one_in, question_weights, read_world_file, refuse_unknown, section, shipped, shown, world_mapping,
    world_name,
)

WORLDS_DIR = Path(__file__).resolve().parent.parent / "worlds" / "seeking"
SEEKING_KINDS = ("count", "exists", "colour", "entity", "fact")
TEMPLATES = {  # each kind's canonical wording
    "count": "How many {c} {s}s are there?",
    "exists": "Is there a {c} {s}?",
    "colour": "What colour is the leftmost {s}?",
    "entity": "Which guild has the leftmost {s} as its emblem?",
    "fact": "In which year was the guild with the leftmost {s} as its emblem founded?",
}
COLOURED = ("count", "exists")  # the kinds whose answer depends on a colour as well as a shape
SEEKING_TOOLS = ("caption", "vqa", "detect", "select", "classify", "image_search", "text_search")  # in path order
MAX_CALL_COST = 100.0  # per call of one tool or agent (answer_reward is 10 by default)
AGENT_KEY = re.compile(r"^agent:[A-Za-z0-9_-]{1,64}$")


FIELDS = {kind: ("c", "s") if kind in COLOURED else ("s",) for kind in SEEKING_KINDS}  # each wording's placeholders


@dataclass(frozen=True)
class SeekingWorld:
    """One offline information-seeking world (see the module docstring for what each field means)."""

    name: str = "seeking"
    questions: dict[str, float] = field(default_factory=lambda: {k: 1.0 for k in SEEKING_KINDS})
    phrasings: dict[str, tuple[str, ...]] = field(default_factory=lambda: {k: (t,) for k, t in TEMPLATES.items()})
    guess_right_one_in: int = 3
    call_costs: dict[str, float] = field(default_factory=dict)
    requires: dict[str, str] = field(default_factory=dict)

    def call_cost(self, action: str) -> float:
        """What calling ``action`` (a tool, or ``agent:<name>``) costs in this world (0 unless the file says)."""
        return self.call_costs.get(action, 0.0)

    def missing_prerequisite(self, tool: str, called: list[str]) -> str:
        """The tool whose result ``tool`` needs in the working memory and that is not among ``called`` ("" when
        none is missing)."""
        needed = self.requires.get(tool, "")
        return needed if needed and needed not in called else ""

    def with_prerequisites(self, path: tuple[str, ...]) -> tuple[str, ...]:
        """``path`` with every tool it needs first (transitively), in the tools' order (:data:`SEEKING_TOOLS`)."""
        wanted, todo = set(path), list(path)
        while todo:
            needed = self.requires.get(todo.pop(), "")
            if needed and needed not in wanted:
                wanted.add(needed)
                todo.append(needed)
        return tuple(t for t in SEEKING_TOOLS if t in wanted) + tuple(t for t in path if t not in SEEKING_TOOLS)

    @cached_property
    def _patterns(self) -> list[tuple[str, re.Pattern[str]]]:
        return [(kind, wording_pattern(t)) for kind in SEEKING_KINDS for t in self.phrasings[kind]]

    def parse(self, question: str) -> tuple[str, dict[str, str]] | None:
        """(kind, {"c": colour, "s": shape}) of a question in any of this world's wordings, or None."""
        for kind, pattern in self._patterns:
            match = pattern.match(question.strip())
            if match and all(v in COLOURS + SHAPES for v in match.groupdict().values()):
                return kind, match.groupdict()
        return None

    def canonical(self, kind: str, **groups: str) -> str:
        """The kind's first wording, filled in."""
        return self.phrasings[kind][0].format(**groups)

    def draw_kind(self, rng: np.random.Generator, kinds: tuple[str, ...]) -> str:
        """A question kind among ``kinds`` by the world's weights (one integer draw when they are equal)."""
        weights = np.asarray([self.questions.get(k, 0.0) for k in kinds], dtype=np.float64)
        if weights.sum() <= 0:
            raise ValueError(f"world {self.name}: none of the kinds {list(kinds)} has a question weight above 0")
        if np.all(weights == weights[0]):
            return kinds[int(rng.integers(len(kinds)))]
        return kinds[int(rng.choice(len(kinds), p=weights / weights.sum()))]

    def phrasings_for(self, kind: str, split: str) -> tuple[str, ...]:
        """The wordings a ``kind`` question of a ``split`` task is asked in (:func:`wordings_for_split`: a wording
        seen only at test where the kind has :data:`~clova_train.envs.common.world.TEST_ONLY_FROM` or more)."""
        return wordings_for_split(self.phrasings[kind], split)

    def phrase(self, kind: str, task_id: int, **groups: str) -> str:
        """Task ``task_id``'s wording of a ``kind`` question (drawn by the task id among :meth:`phrasings_for` its
        split when the kind has several)."""
        return task_wording(self.phrasings[kind], task_id).format(**groups)

    def identity(self) -> dict[str, Any]:
        """Everything that changes the offline LLM's replies and the tools' answers (part of the call cache's key)."""
        return {"name": self.name, "questions": dict(self.questions),
                "phrasings": {k: list(v) for k, v in self.phrasings.items()},
                "guess_right_one_in": self.guess_right_one_in,
                **({"call_costs": dict(self.call_costs)} if self.call_costs else {}),
                **({"requires": dict(self.requires)} if self.requires else {})}

    def to_dict(self) -> dict[str, Any]:
        """The world in its file form (what :func:`world_from_dict` reads back to an equal world)."""
        tools: dict[str, Any] = {"guess_right_one_in": self.guess_right_one_in}
        if self.call_costs:
            tools["call_costs"] = dict(self.call_costs)
        if self.requires:
            tools["requires"] = dict(self.requires)
        return {"name": self.name, "questions": dict(self.questions),
                "phrasings": {k: list(v) for k, v in self.phrasings.items()}, "tools": tools}


def world_from_dict(raw: Any, where: str) -> SeekingWorld:
    """A world from its file form (module docstring), every value checked; ``where`` names the source."""
    world_mapping(raw, ("name", "questions", "phrasings", "tools"), where)
    default = SeekingWorld()
    name = world_name(raw, where)
    questions = question_weights(raw, SEEKING_KINDS, default.questions, where)
    given = section(raw, "phrasings", where)
    refuse_unknown(given, SEEKING_KINDS, f"{where}: phrasings")
    phrasings = read_phrasings(given, FIELDS, default.phrasings, where)
    tools = section(raw, "tools", where)
    refuse_unknown(tools, ("guess_right_one_in", "call_costs", "requires"), f"{where}: tools")
    world = SeekingWorld(name, questions, phrasings, guess_right_one_in(tools, default.guess_right_one_in, where),
                         _call_costs(tools, where), _requires(tools, where))
    check_unambiguous(world.phrasings, FIELDS, world.parse, where)
    return world


def _call_costs(tools: dict[str, Any], where: str) -> dict[str, float]:
    """``tools.call_costs``: a tool name or ``agent:<name>`` -> a cost from 0 to :data:`MAX_CALL_COST`."""
    costs = section(tools, "call_costs", f"{where}: tools")
    for action, cost in costs.items():
        if not isinstance(action, str) or not (action in SEEKING_TOOLS or AGENT_KEY.match(action)):
            raise DataError(f"{where}: tools.call_costs: key {shown(action)} must be a tool "
                            f"({', '.join(SEEKING_TOOLS)}) or agent:<name> (letters, digits, _ and -)")
        if not is_number(cost) or not 0 <= cost <= MAX_CALL_COST:
            raise DataError(f"{where}: tools.call_costs.{action} = {shown(cost)}: must be a number from 0 to "
                            f"{MAX_CALL_COST:g}")
    return {action: float(cost) for action, cost in costs.items()}


def _requires(tools: dict[str, Any], where: str) -> dict[str, str]:
    """``tools.requires``: a tool -> the other tool whose result it needs in memory first; no cycle."""
    requires = section(tools, "requires", f"{where}: tools")
    for tool, needed in requires.items():
        if tool not in SEEKING_TOOLS:
            raise DataError(f"{where}: tools.requires: key {shown(tool)} must be a tool ({', '.join(SEEKING_TOOLS)})")
        if not isinstance(needed, str) or needed not in SEEKING_TOOLS or needed == tool:
            raise DataError(f"{where}: tools.requires.{tool} = {shown(needed)}: must be another tool "
                            f"({', '.join(t for t in SEEKING_TOOLS if t != tool)})")
    for tool in requires:
        chain = [tool]
        while chain[-1] in requires and len(chain) <= len(requires):
            chain.append(requires[chain[-1]])
            if chain[-1] == tool:
                raise DataError(f"{where}: tools.requires: a cycle ({' needs '.join(chain)}): none of these tools "
                                "could ever answer")
    return dict(requires)


def presets() -> list[str]:
    """The names of the shipped worlds."""
    return shipped(WORLDS_DIR).split(", ")


def load_seeking_world(path_or_preset: str) -> SeekingWorld:
    """The world in a YAML/JSON file, or a shipped preset by name; a :class:`DataError` names what is wrong."""
    raw, where = read_world_file(path_or_preset, WORLDS_DIR, "information-seeking world")
    return world_from_dict(raw, where)


DEFAULT_WORLD = SeekingWorld()
