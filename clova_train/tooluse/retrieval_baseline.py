"""A tool-use control that reads every input the tool LLM reads and learns from the same records, with no LLM:
answer each request with the response of the most alike training record, its words carried over.

:class:`NearestRecordBaseline` stores the training records (GPT4Tools' ``{instruction, input, output}``: the prompt
lists the tools, the conversation so far and the ``New input:`` request, followed by the tool steps already taken;
the output is the next step). For a new record it finds the training record whose request shares the most words
(Jaccard) among those at the same point of their request (the same tools already called; else as many), then
rewrites that
record's next step for the new record:

* image paths by role: the neighbour's n-th observation since its request becomes the new record's n-th, and
  the n-th last image named before its request (the one the user provided last, first) the new record's n-th last;
* other words of an ``Action Input`` or ``AI:`` line that come from the neighbour's request become the words at
  the same place of the new request (the requests aligned word by word with :class:`difflib.SequenceMatcher`), so
  "blue circle" taken from "Detect the blue circle" becomes "red square" for "Detect the red square";
* a tool the new prompt does not list (the neighbour's tool is never one a new tool could be) is kept as it is by the
  plain control; ``tool_choice`` names the two variants that replace it by a listed tool not yet called:

  - ``"renaming rule"``: the one whose *name* shares the most words with the neighbour's tool. A hand-written rule
    (nothing learned from the records), which alone gives the control its score on tools it never saw: it is reported
    as its own, named control, "nearest record + renaming rule (hand-written)";
  - ``"descriptions"``: the one whose *description* in the prompt's tool list is most alike the request, by word
    associations learned from the training records only (:class:`DescriptionMatcher`: which request words go with
    which words of the called tool's description, against the other tools the prompt listed).

It is the supervised learner without the language model: what LoRA tuning adds beyond copying the nearest
training example (``benchmarks/tool_llm_learning.py`` reports every variant on the same held-out records).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import Literal

from clova_train.tooluse.react import parse_react

_IMAGE = re.compile(r"\S+\.(?:png|jpe?g|bmp|gif|webp)\b", re.IGNORECASE)
_WORD = re.compile(r"[\w'/.-]+|[^\w\s]")
_REQUEST = re.compile(r"^New input: (.*)$", re.MULTILINE)
_LISTED = re.compile(r"^> ([^:\n]+):", re.MULTILINE)
_DESCRIBED = re.compile(r"^> ([^:\n]+): (.*?)(?: Input: [^\n]*)?$", re.MULTILINE)
_PLAIN_WORD = re.compile(r"[a-z0-9]+")
TOOL_CHOICES = ("copy", "renaming rule", "descriptions")
ToolChoice = Literal["copy", "renaming rule", "descriptions"]


@dataclass(frozen=True)
class _Prompt:
    """What the baseline reads of one record's prompt."""

    request: list[str]  # the New input's words
    called: tuple[str, ...]  # tools called since the New input
    before: list[str]  # image paths named before the New input, in order
    observations: list[str]  # the observations of the steps since the New input
    listed: list[str]  # tool names the prompt lists
    descriptions: dict[str, str]  # each listed tool's description

    def image_roles(self) -> dict[tuple[str, int], str]:
        """Each image path by role: ``("before", n)`` the n-th last before the request, ``("observation", n)``."""
        roles = {("before", n): path for n, path in enumerate(reversed(self.before))}
        roles.update({("observation", n): path for n, path in enumerate(self.observations)})
        return roles


def _read(record: dict) -> _Prompt:
    text = f"{record.get('instruction', '')}\n{record.get('input', '')}"
    matches = list(_REQUEST.finditer(text))
    request = matches[-1].group(1) if matches else ""
    start, end = (matches[-1].start(), matches[-1].end()) if matches else (len(text), len(text))
    steps = parse_react(text[end:]).tool_steps if text[end:].strip() else []
    observations = [m.group(1) for m in re.finditer(r"^Observation: (\S+)", text[end:], re.MULTILINE)]
    return _Prompt(_WORD.findall(request), tuple(step.action for step in steps),
                   list(dict.fromkeys(_IMAGE.findall(text[:start]))), observations, _LISTED.findall(text),
                   {m.group(1): m.group(2) for m in _DESCRIBED.finditer(text)})


def _jaccard(a: Sequence[str], b: Sequence[str]) -> float:
    left, right = {w.lower() for w in a}, {w.lower() for w in b}
    return len(left & right) / max(1, len(left | right))


def _word_map(source: list[str], target: list[str]) -> dict[str, str]:
    """Each word of ``source`` that sits in an aligned block of the same length, mapped to ``target``'s word there."""
    mapping: dict[str, str] = {}
    for tag, i1, i2, j1, j2 in SequenceMatcher(a=[w.lower() for w in source], b=[w.lower() for w in target],
                                                autojunk=False).get_opcodes():
        if tag in ("equal", "replace") and i2 - i1 == j2 - j1:
            for i, j in zip(range(i1, i2), range(j1, j2)):
                mapping.setdefault(source[i], target[j])
    return mapping


def _plain_words(text: str) -> set[str]:
    return set(_PLAIN_WORD.findall(text.lower()))


class DescriptionMatcher:
    """Which listed tool a request asks for, from the tools' descriptions, with word associations learned from
    training records: for each record whose next step calls a listed tool, every (request word, description word)
    pair of the called tool gains 1 and those of the other listed tools lose their share (a one-pass perceptron over
    word pairs). A tool's score for a new request is the sum of its pairs' weights over the number of pairs.

    Args:
        records: the training records (their prompts' tool lists and their outputs' first tool are read).
    """

    def __init__(self, records: Sequence[dict]) -> None:
        self.weights: dict[tuple[str, str], float] = {}
        for record in records:
            prompt = _read(record)
            steps = parse_react(str(record.get("output", ""))).tool_steps
            if not steps or steps[0].action not in prompt.descriptions or len(prompt.descriptions) < 2:
                continue
            request = {w for word in prompt.request for w in _plain_words(word)}
            others = len(prompt.descriptions) - 1
            for tool, description in prompt.descriptions.items():
                gain = 1.0 if tool == steps[0].action else -1.0 / others
                for pair in ((w, d) for w in request for d in _plain_words(description)):
                    self.weights[pair] = self.weights.get(pair, 0.0) + gain

    def score(self, request: Sequence[str], description: str) -> float:
        """How much ``request`` (its words) asks for the tool ``description`` describes."""
        words = {w for word in request for w in _plain_words(word)}
        pairs = [(w, d) for w in words for d in _plain_words(description)]
        return sum(self.weights.get(pair, 0.0) for pair in pairs) / max(1, len(pairs))


class NearestRecordBaseline:
    """The nearest-training-record control (module docstring).

    Args:
        records: the training records (``instruction``, optional ``input``, ``output``).
        tool_choice: what becomes of a neighbour's tool the new prompt does not list: ``"copy"`` (kept: the plain
            control), ``"renaming rule"`` (the listed tool whose name is most alike, a hand-written rule) or
            ``"descriptions"`` (the listed tool whose description is most alike the request, learned from
            ``records``).
    """

    def __init__(self, records: Sequence[dict], tool_choice: ToolChoice = "copy") -> None:
        if not records:
            raise ValueError("the nearest-record baseline needs at least one training record")
        if tool_choice not in TOOL_CHOICES:
            raise ValueError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)}, not {tool_choice!r}")
        self.records = [(_read(r), str(r["output"])) for r in records]
        self.tool_choice = tool_choice
        self.matcher = DescriptionMatcher(records) if tool_choice == "descriptions" else None

    def predict(self, record: dict) -> str:
        """The response to ``record`` (its ``output``, if any, is not read)."""
        prompt = _read(record)
        same_point = ([(p, o) for p, o in self.records if p.called == prompt.called]
                      or [(p, o) for p, o in self.records if len(p.called) == len(prompt.called)] or self.records)
        neighbour, response = max(same_point, key=lambda item: _jaccard(item[0].request, prompt.request))
        return self._rewrite(response, neighbour, prompt)

    def _rewrite(self, response: str, neighbour: _Prompt, prompt: _Prompt) -> str:
        theirs, ours = neighbour.image_roles(), prompt.image_roles()
        images = {path: ours[role] for role, path in theirs.items() if role in ours}
        words = _word_map(neighbour.request, prompt.request)
        lines = []
        for line in response.splitlines():
            head, colon, value = line.partition(": ")
            if head == "Action" and colon:
                value = self._listed_tool(value, prompt)
            elif head in ("Action Input", "AI") and colon:
                value = _IMAGE.sub(lambda m: images.get(m.group(0), m.group(0)), value)
                value = " ".join(_carry(token, words) for token in value.split(" "))
            lines.append(f"{head}{colon}{value}" if colon else line)
        return "\n".join(lines)

    def _listed_tool(self, tool: str, prompt: _Prompt) -> str:
        if self.tool_choice == "copy" or not prompt.listed or tool in prompt.listed:
            return tool
        free = [t for t in prompt.listed if t not in prompt.called] or prompt.listed
        if self.matcher is not None:
            return max(free, key=lambda t: self.matcher.score(prompt.request, prompt.descriptions.get(t, "")))
        return max(free, key=lambda t: _jaccard(t.split(), tool.split()))


def _carry(token: str, words: dict[str, str]) -> str:
    """A token of the neighbour's reply with a request word replaced (punctuation around it kept)."""
    core = token.strip(",.")
    if not core or core not in words or _IMAGE.fullmatch(core):
        return token
    return token.replace(core, words[core], 1)
