"""An offline world of the HYDRA reasoning loop, described by a file: which questions, how the planner misleads,
how the tools behave, and default rewards.

``hydra.world`` names a shipped preset (``envs/worlds/<name>.yaml``: ``shapes``, the default, ``shapes-replan`` and
``shapes-paraphrased``) or a YAML/JSON file of this form (every key optional; the defaults are the ``shapes``
world)::

    name: my-world
    questions: {count: 1, exists: 1, colour: 1, compare: 1}   # question kinds drawn, with weights
    phrasings:               # per kind, the wordings users ask in ({c}: a colour, {s}: a shape; a comparison's second
      count:                 # group {c2} {s2}); one is drawn per task. The first is the canonical wording; a kind
        - "How many {c} {s}s are there?"         # with three or more keeps its last for test tasks only
        - "Count the {c} {s}s: how many are there?"
        - "What is the number of {c} {s}s in the picture?"
    planner:
      confidence: [0.30, 0.95]   # the N confidences: distinct 2-decimal values drawn from this range
      has_good: [0.95]           # chance that a list holds a good instruction, by attempt (0: first list of a step,
                                 # 1: after one re-plan, ...; the last value repeats)
      good_rank:                 # where the good instruction sits among the N confidences, per step:
        count: 0                 # 0 the highest, 1 the second, -1 the lowest; "random": any rank
        exists: -1
        colour: 1
        compare-1: -1            # a comparison's first count ...
        compare-2: 0             # ... and its second, once the memory holds the first
      malformed: 0.05            # chance that a reply has one line too few or too many
    tools:
      guess_right_one_in: 3      # simple_query / llm_query guess: the gold answer once in k questions
    rewards: {r1: 100, alpha: 100, error_penalty: 10, reject_penalty: 0}   # used where the env config leaves null

The scripted planner understands every wording of the world, as an LLM would (its samples for a question do not
depend on the wording's meaning, only on its text as the seed of its draws). The controller reads the question's
text in its observation, so a wording seen only at test asks whether it learned the question or its words.

The scenes, the instruction wordings and the code each kind of instruction runs are the world's fixed vocabulary
(:mod:`clova_train.envs.common.world`, :mod:`clova_train.envs.hydra.scripted`); everything that decides what a
controller has to learn is here. Loading checks every value and names the file and key at fault (a wording with
another placeholder than its kind's, or one that reads as another kind's question, is refused); nothing in the
file is run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from clova_train.core.checks import is_integer, is_number
from clova_train.core.errors import DataError
from clova_train.envs.common.wordings import check_unambiguous, read_phrasings, wording_pattern
from clova_train.envs.common.world import QUESTION_FIELDS, QUESTION_TEMPLATES, QUESTION_TYPES, TEST_ONLY_FROM
from clova_train.envs.common.world_file import (
    guess_right_one_in, question_weights, read_world_file, refuse_unknown, section, shipped, shown, world_mapping,
    world_name,
)

WORLDS_DIR = Path(__file__).resolve().parent.parent / "worlds"
STEPS = ("count", "exists", "colour", "compare-1", "compare-2")
RANDOM_RANK = "random"
REWARD_KEYS = ("r1", "alpha", "error_penalty", "reject_penalty")
MAX_RANK = 1_000  # |good_rank|: no planner list holds more samples
MAX_REWARD = 1e6  # |reward|: the paper's are 100; larger ones only overflow the Q-values
MAX_ATTEMPTS = 100  # planner.has_good entries (one per re-plan)


@dataclass(frozen=True)
class ReasoningWorld:
    """One offline world (see the module docstring for what each field means)."""

    name: str = "shapes"
    questions: dict[str, float] = field(default_factory=lambda: {k: 1.0 for k in QUESTION_TYPES})
    confidence: tuple[float, float] = (0.30, 0.95)
    has_good: tuple[float, ...] = (0.95,)
    good_rank: dict[str, int | str] = field(default_factory=lambda: {"count": 0, "exists": -1, "colour": 1,
                                                                      "compare-1": -1, "compare-2": 0})
    malformed: float = 0.05
    guess_right_one_in: int = 3
    rewards: dict[str, float] = field(default_factory=dict)
    phrasings: dict[str, tuple[str, ...]] = field(default_factory=lambda: {k: (t,) for k, t in
                                                                          QUESTION_TEMPLATES.items()})

    @cached_property
    def _patterns(self) -> list[tuple[str, re.Pattern[str]]]:
        # Found anywhere in the text, as the canonical patterns always were (a task file's question may hold one).
        return [(kind, wording_pattern(t, anchored=False)) for kind in QUESTION_TYPES for t in self.phrasings[kind]]

    def parse_question(self, question: str) -> tuple[str, dict[str, str]] | None:
        """(question type, its groups: ``c``, ``s`` and a comparison's ``c2``, ``s2``) of a question in any of the
        world's wordings, or None."""
        for kind, pattern in self._patterns:
            match = pattern.search(question)
            if match:
                return kind, {k: v for k, v in match.groupdict().items() if v}
        return None

    def held_out_wording(self, question_type: str, question: str) -> bool:
        """Whether ``question`` (of ``question_type``) is asked in the type's wording that only test tasks get."""
        wordings = self.phrasings.get(question_type, ())
        return len(wordings) >= TEST_ONLY_FROM and wording_pattern(wordings[-1]).match(question.strip()) is not None

    def has_default_phrasings(self) -> bool:
        """Whether every question type has only its canonical wording."""
        return all(self.phrasings[k] == (t,) for k, t in QUESTION_TEMPLATES.items())

    def _phrasings_entry(self) -> dict[str, Any]:
        # Left out when canonical, so the identity (the LLM cache's key) and the file form of every world written
        # before worlds had wordings stay as they were.
        return {} if self.has_default_phrasings() else {"phrasings": {k: list(v) for k, v in self.phrasings.items()}}

    def sample_count_problems(self, num_samples: int, where: str) -> list[str]:
        """What cannot hold with ``num_samples`` samples per list (``where`` names the world): a good-sample rank
        outside the list, or a confidence range with fewer distinct 2-decimal values than samples."""
        n, problems = num_samples, []
        for step, rank in self.good_rank.items():
            if rank != RANDOM_RANK and not -n <= int(rank) < n:
                problems.append(f"{where}: planner.good_rank.{step} = {rank}: must be a rank among the {n} samples "
                                f"({-n} to {n - 1}) or 'random'")
        low, high = (round(100 * c) for c in self.confidence)
        if high - low + 1 < n:
            problems.append(f"{where}: planner.confidence = {list(self.confidence)}: holds {high - low + 1} "
                            f"distinct 2-decimal values, fewer than the {n} samples")
        return problems

    def has_good_at(self, attempt: int) -> float:
        """The chance that the list of attempt ``attempt`` (0: the step's first) holds a good instruction."""
        return self.has_good[min(attempt, len(self.has_good) - 1)]

    def identity(self) -> dict[str, Any]:
        """Everything that changes the planner's replies (part of the LLM call cache's key)."""
        return {"name": self.name, "questions": self.questions, "confidence": list(self.confidence),
                "has_good": list(self.has_good), "good_rank": self.good_rank, "malformed": self.malformed,
                **self._phrasings_entry()}

    def as_dict(self) -> dict[str, Any]:
        """The world in its file form (``load_world`` of it gives it back)."""
        return {"name": self.name, "questions": dict(self.questions),
                **self._phrasings_entry(),
                "planner": {"confidence": list(self.confidence), "has_good": list(self.has_good),
                            "good_rank": dict(self.good_rank), "malformed": self.malformed},
                "tools": {"guess_right_one_in": self.guess_right_one_in}, "rewards": dict(self.rewards)}


def _probability(value: Any, where: str) -> float:
    if not is_number(value) or not 0 <= value <= 1:
        raise DataError(f"{where} = {shown(value)}: must be a number between 0 and 1")
    return float(value)


def world_from_dict(raw: Any, where: str) -> ReasoningWorld:
    """A world from its file form (module docstring), every value checked; ``where`` names the source."""
    world_mapping(raw, ("name", "questions", "phrasings", "planner", "tools", "rewards"), where)
    default = ReasoningWorld()
    name = world_name(raw, where)
    questions = question_weights(raw, QUESTION_TYPES, default.questions, where)
    given = section(raw, "phrasings", where)
    refuse_unknown(given, QUESTION_TYPES, f"{where}: phrasings")
    phrasings = read_phrasings(given, QUESTION_FIELDS, default.phrasings, where)
    planner = section(raw, "planner", where)
    refuse_unknown(planner, ("confidence", "has_good", "good_rank", "malformed"), f"{where}: planner")
    confidence = planner.get("confidence", list(default.confidence))
    if (not isinstance(confidence, list) or len(confidence) != 2 or not all(is_number(c) for c in confidence)
            or not 0 < confidence[0] < confidence[1] <= 1):
        raise DataError(f"{where}: planner.confidence = {shown(confidence)}: must be [low, high] with 0 < low < high <= 1")
    has_good = planner.get("has_good", list(default.has_good))
    has_good = has_good if isinstance(has_good, list) else [has_good]
    if not 1 <= len(has_good) <= MAX_ATTEMPTS:
        raise DataError(f"{where}: planner.has_good must hold at least one probability and at most {MAX_ATTEMPTS}, "
                        f"got {len(has_good)}")
    has_good = [_probability(p, f"{where}: planner.has_good[{i}]") for i, p in enumerate(has_good)]
    ranks = section(planner, "good_rank", f"{where}: planner")
    refuse_unknown(ranks, STEPS, f"{where}: planner.good_rank")
    good_rank = {**default.good_rank, **ranks}
    for step, rank in good_rank.items():
        if rank != RANDOM_RANK and not (is_integer(rank) and -MAX_RANK <= rank < MAX_RANK):
            raise DataError(f"{where}: planner.good_rank.{step} = {shown(rank)}: must be an integer rank "
                            f"({-MAX_RANK} to {MAX_RANK - 1}) or 'random'")
    malformed = _probability(planner.get("malformed", default.malformed), f"{where}: planner.malformed")
    tools = section(raw, "tools", where)
    refuse_unknown(tools, ("guess_right_one_in",), f"{where}: tools")
    guess = guess_right_one_in(tools, default.guess_right_one_in, where)
    rewards = section(raw, "rewards", where)
    refuse_unknown(rewards, REWARD_KEYS, f"{where}: rewards")
    for key, value in rewards.items():
        low = 0 if key in ("error_penalty", "reject_penalty") else -MAX_REWARD
        if not is_number(value) or not low <= value <= MAX_REWARD:
            raise DataError(f"{where}: rewards.{key} = {shown(value)}: must be a number from {low:g} to {MAX_REWARD:g}")
    world = ReasoningWorld(name, questions,
                           (float(confidence[0]), float(confidence[1])), tuple(has_good), good_rank, malformed,
                           int(guess), {k: float(v) for k, v in rewards.items()}, phrasings)
    check_unambiguous(world.phrasings, QUESTION_FIELDS, world.parse_question, where)
    return world


def presets() -> list[str]:
    """The names of the shipped worlds."""
    return shipped(WORLDS_DIR).split(", ")


def load_world(path_or_preset: str) -> ReasoningWorld:
    """The world in a YAML/JSON file, or a shipped preset by name; a :class:`DataError` names what is wrong."""
    raw, where = read_world_file(path_or_preset, WORLDS_DIR, "world")
    return world_from_dict(raw, where)
