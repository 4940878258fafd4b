"""The LLM-facing parts of the AVIS and HAMMR environments: working memory, planner, reasoner, dispatcher.

Each part writes a plain-text prompt and parses the reply, so a served LLM, a local transformers model or the
offline :class:`~clova_train.envs.avis.scripted.ScriptedSeekingLLM` can stand behind it. Replies are
untrusted: an unknown action, label or agent name is read as "no usable reply" (the first feasible action,
``uninformative``, no agent), never an error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from clova_train.core.observation_builder import (
    AGENT_MEMORY_LINES_SHOWN, agent_memory_line, memory_text, tool_output_line,
)
from clova_train.llm.backends import ChatBackend, ask

Label = Literal["informative", "uninformative", "answer"]
MAX_QUERY_CHARS = 300


def _field(reply: str, name: str) -> str:
    match = re.search(rf"^\s*{name}\s*:[ \t]*(.*)$", reply, flags=re.MULTILINE | re.IGNORECASE)
    return match.group(1).strip() if match else ""


@dataclass
class MemoryEntry:
    """One tool result in the working memory: the action, its query, its output and the reasoner's label."""

    action: str
    query: str
    output: str
    label: Label

    def line(self) -> str:
        return agent_memory_line(self.label, self.action, self.output)


@dataclass
class WorkingMemory:
    """AVIS's working memory: every tool result of the episode, in order, with its label."""

    entries: list[MemoryEntry] = field(default_factory=list)

    def add(self, entry: MemoryEntry) -> None:
        self.entries.append(entry)

    def text(self, last: int = AGENT_MEMORY_LINES_SHOWN) -> str:
        return memory_text([e.line() for e in self.entries], last)


@dataclass(frozen=True)
class Example:
    """An in-context example of the planner: a question and the tools a person used, in order."""

    question: str
    path: tuple[str, ...]

    def line(self) -> str:
        return f"Q: {self.question} -> {', '.join(self.path)}"


class SeekingPlanner:
    """AVIS Algorithm 1: given the feasible actions, the examples and the memory, the LLM names the next action
    and its query; with ``chosen`` (the controller's pick) it only writes that action's query.

    Args:
        backend: chat backend.
        examples: the in-context examples, in prompt order.
    """

    def __init__(self, backend: ChatBackend, examples: tuple[Example, ...]) -> None:
        self.backend, self.examples = backend, examples

    def prompt(self, question: str, state: str, feasible: list[str], memory: WorkingMemory, chosen: str = "") -> str:
        examples = "\n".join(e.line() for e in self.examples) or "(none)"
        lines = [f"Question: {question}", f"State: {state}", f"Feasible actions: {', '.join(feasible)}"]
        if chosen:
            lines.append(f"Chosen action: {chosen}")
        return ("Choose the next tool to answer a question about an image.\n" + "\n".join(lines)
                + f"\n\nWorking memory:\n{memory.text()}\n\nExamples:\n{examples}\n\n"
                "Reply as:\nAction: <one feasible action>\nQuery: <the tool's input>")

    def propose(self, question: str, state: str, feasible: list[str], memory: WorkingMemory,
                chosen: str = "") -> tuple[str, str]:
        reply = ask(self.backend, [{"role": "user", "content": self.prompt(question, state, feasible, memory, chosen)}])
        action = _field(reply, "Action")
        if chosen:
            action = chosen
        elif action not in feasible:
            action = feasible[0] if feasible else ""
        return action, _field(reply, "Query")[:MAX_QUERY_CHARS]


class SeekingReasoner:
    """AVIS's reasoner: labels a tool output informative, uninformative or a final answer.

    Args:
        backend: chat backend.
    """

    def __init__(self, backend: ChatBackend) -> None:
        self.backend = backend

    @staticmethod
    def prompt(question: str, action: str, query: str, output: str, memory: WorkingMemory) -> str:
        return ("Label the output of a tool call for answering the question.\n"
                f"Question: {question}\nTool: {action}\nQuery: {query}\nOutput: {output}\n\n"
                f"Working memory:\n{memory.text()}\n\n"
                "Reply as:\nLabel: informative | uninformative | answer\nAnswer: <the final answer, when the label is answer>")

    def judge(self, question: str, action: str, query: str, output: str, memory: WorkingMemory) -> tuple[Label, str]:
        reply = ask(self.backend, [{"role": "user", "content": self.prompt(question, action, query, output, memory)}])
        label = _field(reply, "Label").lower()
        if label == "answer":
            answer = _field(reply, "Answer")
            return ("answer", answer) if answer else ("uninformative", "")
        return ("informative", "") if label == "informative" else ("uninformative", "")


class Dispatcher:
    """HAMMR's question dispatcher: the LLM names the agent to call from their descriptions and example questions.

    Args:
        backend: chat backend.
        agents: (name, description) of every agent, in order.
        examples: per agent name, the example questions its prompt shows (HAMMR refines the dispatcher's prompt
            on validation questions of each type; here, each agent's own in-context examples).
    """

    def __init__(self, backend: ChatBackend, agents: list[tuple[str, str]],
                 examples: dict[str, list[str]] | None = None) -> None:
        self.backend, self.agents, self.examples = backend, agents, examples or {}

    def _line(self, name: str, description: str) -> str:
        examples = " | ".join(" ".join(q.split()) for q in self.examples.get(name, []))
        return f"- {name}: {description}" + (f" Examples: {examples}" if examples else "")

    def prompt(self, question: str, memory: WorkingMemory) -> str:
        listed = "\n".join(self._line(name, description) for name, description in self.agents)
        return (f"Choose the agent that should answer the question.\nQuestion: {question}\n\nAgents:\n{listed}\n\n"
                f"Earlier calls:\n{memory.text()}\n\nReply as:\nAgent: <name>")

    def choose(self, question: str, memory: WorkingMemory) -> str:
        reply = ask(self.backend, [{"role": "user", "content": self.prompt(question, memory)}])
        name = _field(reply, "Agent")
        return name if name in dict(self.agents) else ""


clip_output = tool_output_line  # a tool's or an agent's output as it enters prompts and memory
