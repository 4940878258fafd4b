"""AVIS's transition graph: which actions are feasible in which state, given as data and checked on load.

A graph file (YAML or JSON)::

    name: avis-figure3
    start: START
    actions: [caption, vqa, detect, select, classify, image_search, text_search]   # the action space, in order
    answers: [vqa, detect, classify, image_search, text_search]   # actions whose result can be a final answer
    states:                                                     # state -> actions feasible there
      START: [caption, vqa, detect]
      detect: [select, vqa, caption]
      ...

A state is ``start`` or the name of the last action whose result was informative (AVIS Algorithm 2: an
informative result moves the search to the state named after the tool, an uninformative one stays). So every
action that some state lists must have a state entry of its own (possibly ``[]``, a dead end), and from
``start`` some path must reach an answer action. :func:`load_graph` rejects a file that breaks one of these
rules with a message naming the state or edge at fault.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from clova_train.core.errors import ClovaTrainError, DataError
from clova_train.core.safe_files import ReadLimits, parse_json, parse_yaml, read_text
from clova_train.envs.common.world_file import preset_or_file, shipped

GRAPH_LIMITS = ReadLimits(max_bytes=16 << 20, max_depth=32)
PRESETS_DIR = Path(__file__).resolve().parent.parent / "graphs"  # data, shared by the families


class GraphError(ClovaTrainError):
    """A transition graph file is missing or breaks a rule of :mod:`clova_train.envs.avis.transition_graph`."""


@dataclass(frozen=True)
class TransitionGraph:
    """A validated transition graph (see the module docstring).

    Args:
        name: a label for reports.
        start: the initial state.
        actions: the action space, in order (action ``i`` of the environment is ``actions[i]``).
        answers: actions whose result may be a final answer.
        states: state -> feasible actions.
    """

    name: str
    start: str
    actions: tuple[str, ...]
    answers: frozenset[str]
    states: dict[str, tuple[str, ...]]

    def feasible(self, state: str) -> tuple[str, ...]:
        return self.states[state]

    def index(self, action: str) -> int:
        return self.actions.index(action)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "start": self.start, "actions": list(self.actions),
                "answers": sorted(self.answers), "states": {s: list(a) for s, a in self.states.items()}}


def _strings(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise GraphError(f"{where} must be a list of names, got {value!r}")
    return value


def graph_from_dict(raw: Any, source: str = "graph") -> TransitionGraph:
    """Build and check a graph from its parsed file (``source`` names it in messages)."""
    if not isinstance(raw, dict):
        raise GraphError(f"{source}: a transition graph is a mapping with start, actions, answers and states")
    missing = [key for key in ("actions", "answers", "states") if key not in raw]
    if missing:
        raise GraphError(f"{source}: missing {', '.join(missing)}")
    start = raw.get("start", "START")
    actions = _strings(raw["actions"], f"{source}: actions")
    duplicated = sorted({a for a in actions if actions.count(a) > 1})
    if duplicated:
        raise GraphError(f"{source}: action {duplicated[0]!r} is listed twice in actions")
    if start in actions:
        raise GraphError(f"{source}: the start state {start!r} cannot also be an action")
    answers = _strings(raw["answers"], f"{source}: answers")
    for action in answers:
        if action not in actions:
            raise GraphError(f"{source}: answer action {action!r} is not in actions")
    states_raw = raw["states"]
    if not isinstance(states_raw, dict):
        raise GraphError(f"{source}: states must map each state to its feasible actions")
    states: dict[str, tuple[str, ...]] = {}
    for state, feasible in states_raw.items():
        if state != start and state not in actions:
            raise GraphError(f"{source}: unknown state {state!r} (a state is {start!r} or an action's name)")
        listed = _strings(feasible if feasible is not None else [], f"{source}: states.{state}")
        for action in listed:
            if action not in actions:
                raise GraphError(f"{source}: edge {state} -> {action}: {action!r} is not an action")
        states[str(state)] = tuple(dict.fromkeys(listed))
    if start not in states:
        raise GraphError(f"{source}: no entry for the start state {start!r}")
    for state, feasible in states.items():
        for action in feasible:
            if action not in states:
                raise GraphError(f"{source}: edge {state} -> {action} leads nowhere: state {action!r} has no entry "
                                 "(give it its feasible actions, or [] for a dead end)")
    if not _reaches_answer(start, states, set(answers)):
        raise GraphError(f"{source}: no path from {start} reaches an answer action ({', '.join(answers) or 'none'})")
    return TransitionGraph(str(raw.get("name", source)), start, tuple(actions), frozenset(answers), states)


def _reaches_answer(start: str, states: dict[str, tuple[str, ...]], answers: set[str]) -> bool:
    seen, queue = {start}, deque([start])
    while queue:
        for action in states[queue.popleft()]:
            if action in answers:
                return True
            if action not in seen:
                seen.add(action)
                queue.append(action)
    return False


def load_graph(path_or_preset: str) -> TransitionGraph:
    """A graph from a YAML/JSON file, or a shipped preset by name (``avis``: the paper's Figure 3, adapted)."""
    path = preset_or_file(path_or_preset, PRESETS_DIR)
    if path is None:
        raise GraphError(f"transition graph {path_or_preset!r} is neither a file nor a preset ({shipped(PRESETS_DIR)})")
    try:
        text = read_text(path, "file", GRAPH_LIMITS.max_bytes)
        raw = parse_json(text, "its text", GRAPH_LIMITS) if path.suffix == ".json" else parse_yaml(text, "its text", GRAPH_LIMITS)
    except DataError as err:
        raise GraphError(f"transition graph {path}: cannot be read: {err}") from None
    return graph_from_dict(raw, str(path))


def restrict(graph: TransitionGraph, tools: list[str]) -> TransitionGraph:
    """The sub-graph over ``tools`` only (an agent given a subset of the tools), checked like a file."""
    unknown = [t for t in tools if t not in graph.actions]
    if unknown:
        raise GraphError(f"{graph.name}: tool {unknown[0]!r} is not an action of the graph")
    kept = [a for a in graph.actions if a in tools]
    raw = {"name": f"{graph.name}[{', '.join(kept)}]", "start": graph.start, "actions": kept,
           "answers": [a for a in graph.answers if a in tools],
           "states": {s: [a for a in feasible if a in tools] for s, feasible in graph.states.items()
                      if s == graph.start or s in tools}}
    return graph_from_dict(raw, raw["name"])
