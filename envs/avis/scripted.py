"""An offline stand-in for the LLM of the AVIS and HAMMR environments, speaking their text protocol.

:class:`ScriptedSeekingLLM` is a :class:`~clova_train.llm.backends.ChatBackend` that answers three prompts
written by :mod:`clova_train.envs.avis.parts`, as a temperature-0 model would (a deterministic function of
the prompt):

* **planner** (AVIS Algorithm 1): reads the question, the feasible actions, the working memory and its in-context
  examples (``Q: <question> -> tool, tool, ...``), follows the example most like the question (word overlap) past
  the steps already informative, and writes the tool's query from the memory (the selected object for a crop tool,
  the guild name for a web search, a sub-question for an agent). By default it reads every example of its prompt, as
  an LLM given them does; ``context_examples=k`` makes it read only the last k, a small model's limited attention
  over a long prompt (an ablation: it handicaps the untrained planner, so a learner's gain over it measures the
  handicap). A tool output in memory that says it needs another tool's result first makes it call that tool when
  feasible (the world file's ``requires``). When none of the examples it reads is like the question it asks the
  question directly (``vqa``), the shortcut that answers existence questions and guesses the rest.
* **reasoner**: labels a tool output ``informative``, ``uninformative`` or ``answer`` (with the answer), as the
  output and the question's kind allow (AVIS's reasoner; an answer of another kind than the question asks for,
  a colour to a yes/no question, is uninformative).
* **dispatcher** (HAMMR's prompted dispatcher, whose prompt the paper refines on a few dozen validation
  questions per type): picks the agent with an example question most like the question (word overlap, as the
  planner), and when no agent's example is alike, the agent whose description shares the most content words
  with the question (ties: the first listed).
"""

from __future__ import annotations

import re
from typing import Any

from clova_train.llm.backends import ChatBackend, Message
from clova_train.envs.hydra.scripted import prompt_field
from clova_train.envs.avis.seeking_world import DEFAULT_WORLD, SeekingWorld
from clova_train.envs.avis.world import GUILDS, NO_RESULT
from clova_train.envs.common.world import COLOURS

STOPWORDS = frozenset("a an the is are of in on as its it to and or e g eg such there what which how was with".split())
_WORD = re.compile(r"[a-z0-9]+")
NEEDS = re.compile(r"needs an? (\w+) result first")  # a tool's output when the world requires another's first
SIMILAR = 0.25  # least word overlap (Jaccard) for an example to count as "like the question"


def words(text: str, content_only: bool = False) -> set[str]:
    found = set(_WORD.findall(text.lower()))
    return found - STOPWORDS if content_only else found


def similarity(question: str, example: str) -> float:
    """Word overlap (Jaccard) of two questions."""
    asked, other = words(question), words(example)
    return len(asked & other) / max(1, len(asked | other))


def _section(prompt: str, name: str) -> list[str]:
    match = re.search(rf"^{name}:\n(.*?)(?:\n\n|\Z)", prompt, flags=re.MULTILINE | re.DOTALL)
    return [line.strip() for line in match.group(1).splitlines() if line.strip()] if match else []


def _answers_kind(kind: str, answer: str) -> bool:
    """Whether ``answer`` is the kind of answer a question of ``kind`` asks for (a VQA model may name a colour when
    asked whether something is there; the reasoner does not take that for the answer). Unread questions: any."""
    if kind == "count":
        return answer.isdigit()
    if kind == "exists":
        return answer in ("yes", "no")
    if kind == "colour":
        return answer in COLOURS
    return True


class ScriptedSeekingLLM(ChatBackend):
    """Planner, reasoner and dispatcher replies for the information-seeking world (see the module docstring).

    Args:
        context_examples: how many in-context examples (the last ones of the prompt) the planner reads; None: all.
        world: the world whose question wordings it understands (every one, as an LLM would).
    """

    def __init__(self, context_examples: int | None = None, world: SeekingWorld = DEFAULT_WORLD) -> None:
        self.context_examples = context_examples
        self.world = world
        self.calls = 0

    def identity(self) -> dict[str, Any]:
        identity = {"kind": "scripted-seeking", "context_examples": self.context_examples}
        return identity if self.world == DEFAULT_WORLD else {**identity, "world": self.world.identity()}

    def chat(self, messages: list[Message]) -> str:
        self.calls += 1
        prompt = messages[-1]["content"]
        if prompt.startswith("Label the output"):
            return self._reason(prompt)
        if prompt.startswith("Choose the agent"):
            return self._dispatch(prompt)
        return self._plan(prompt)

    # ------------------------------------------------------------------ planner
    def _plan(self, prompt: str) -> str:
        question = prompt_field(prompt, "Question")
        feasible = [a.strip() for a in prompt_field(prompt, "Feasible actions").split(",") if a.strip()]
        chosen = prompt_field(prompt, "Chosen action")
        memory = _section(prompt, "Working memory")
        done = [line.split("]", 1)[1].split(" -> ", 1)[0].strip() for line in memory
                if line.startswith("[informative]")]
        action = chosen or self._missing_tool(feasible, memory) or \
            self._next_action(question, feasible, done, _section(prompt, "Examples"))
        return f"Action: {action}\nQuery: {self._query(action, question, memory)}"

    @staticmethod
    def _missing_tool(feasible: list[str], memory: list[str]) -> str:
        """A tool a result in memory said it needed first (``needs a <tool> result first``), when it is feasible
        now and not yet called: what an LLM reading that line would try ("" when none)."""
        called = {line.split("]", 1)[1].split(" -> ", 1)[0].strip() for line in memory if "]" in line}
        for line in memory:
            match = NEEDS.search(line)
            if match and match.group(1) in feasible and match.group(1) not in called:
                return match.group(1)
        return ""

    def _next_action(self, question: str, feasible: list[str], done: list[str], examples: list[str]) -> str:
        if self.context_examples is None:
            visible = examples
        else:
            visible = examples[-self.context_examples:] if self.context_examples > 0 else []
        best, best_score = None, 0.0
        for line in visible:
            if not line.startswith("Q:") or "->" not in line:
                continue
            example, path = line[2:].split("->", 1)
            score = similarity(question, example)
            if score > best_score:
                best, best_score = [p.strip() for p in path.split(",") if p.strip()], score
        if best is None or best_score < SIMILAR:
            best = ["vqa"]  # no example like it in view: ask the question directly
        for action in best:
            if action not in done and action in feasible:
                return action
        return feasible[0] if feasible else "none"

    def _query(self, action: str, question: str, memory: list[str]) -> str:
        def last(prefix: str) -> str:
            for line in reversed(memory):
                if prefix in line:
                    return line.split(prefix, 1)[1].strip()
            return ""

        parsed = self.world.parse(question)
        if action in ("vqa",):
            return question
        if action == "detect":  # the object the question is about, as an LLM names it to a detector
            if not parsed:
                return "object"
            return f"{parsed[1]['c']} {parsed[1]['s']}" if parsed[1].get("c") else parsed[1]["s"]
        if action == "select":
            return parsed[1]["s"] if parsed else "object"
        if action in ("classify", "image_search"):
            return last("selected: ").split(" at ")[0] or "image"
        if action == "text_search":
            found = last("emblem of ") or last("answer: ")
            return found if found in GUILDS else question
        if action.startswith("agent:"):
            if parsed and parsed[0] == "fact":  # the guild first: its year is one web search away
                return self.world.canonical("entity", s=parsed[1]["s"])
            return question
        return "image"

    # ------------------------------------------------------------------ reasoner
    def _reason(self, prompt: str) -> str:
        question, output = prompt_field(prompt, "Question"), prompt_field(prompt, "Output")
        parsed = self.world.parse(question)
        kind = parsed[0] if parsed else ""
        groups = parsed[1] if parsed else {}

        def answer(value: str) -> str:
            return f"Label: answer\nAnswer: {value}"

        head, _, rest = output.partition(": ")
        if head == "answer":
            if rest in ("unknown", "none", "") or not _answers_kind(kind, rest):
                return "Label: uninformative"
            if kind == "fact" and rest in GUILDS:  # an agent found the guild: the year is still to find
                return "Label: informative"
            return answer(rest)
        if head == "detections":
            found = [d.split(" at ")[0] for d in rest.split(", ") if d]
            target = f"{groups.get('c', '')} {groups.get('s', '')}"
            if kind == "count":
                return answer(str(found.count(target)))
            if kind == "exists":
                return answer("yes" if target in found else "no")
            return "Label: informative" if any(d.endswith(groups.get("s", "?")) for d in found) else answer("none")
        if head == "selected":
            return "Label: informative" if rest != "nothing" and kind in ("colour", "entity", "fact") \
                else "Label: uninformative"
        if head in ("colour", "label"):  # the offline world's CLASSIFY line, a model-backed one's
            return answer(rest) if kind == "colour" and rest != "unknown" else "Label: uninformative"
        if head == "similar images" and rest.startswith("emblem of "):
            found = rest[len("emblem of "):]
            return answer(found) if kind == "entity" else "Label: informative" if kind == "fact" \
                else "Label: uninformative"
        if head == "web" and rest != NO_RESULT and kind == "fact":
            return answer(rest.rsplit(" ", 1)[-1])
        return "Label: uninformative"

    # ------------------------------------------------------------------ dispatcher
    def _dispatch(self, prompt: str) -> str:
        question = prompt_field(prompt, "Question")
        asked = words(question, content_only=True)
        by_example, example_score = "", 0.0
        by_description, description_score = "", -1
        for line in _section(prompt, "Agents"):
            name, _, rest = line.lstrip("- ").partition(":")
            description, _, examples = rest.partition(" Examples: ")
            for example in (e.strip() for e in examples.split(" | ") if e.strip()):
                score = similarity(question, example)
                if score > example_score:
                    by_example, example_score = name.strip(), score
            score = len(asked & words(description, content_only=True))
            if score > description_score:
                by_description, description_score = name.strip(), score
        return f"Agent: {by_example if example_score >= SIMILAR else by_description}"
