"""The ReAct text format of tool-using LLMs (GPT4Tools / Visual ChatGPT) and its parser.

A response is a chain of steps, each either a tool call::

    Thought: Do I need to use a tool? Yes
    Action: <tool name>
    Action Input: <arguments, comma separated>
    Observation: <filled in by the tool runner>

or a final reply::

    Thought: Do I need to use a tool? No
    AI: <reply>

Generation stops at ``Observation:`` (:data:`STOP_STRINGS`) so the runner can call the tool.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

STOP_STRINGS = ("Observation:",)
THOUGHT_PREFIX = "Thought: Do I need to use a tool?"

_LINE = re.compile(
    r"^(?:(?P<thought>Thought: Do I need to use a tool\?)\s*(?P<decision>.*)"
    r"|Action: (?P<action>.*)|Action Input: (?P<input>.*)|AI: (?P<reply>.*))$"
)


@dataclass
class ReActStep:
    """One step: the decision (``"Yes"``/``"No"``), and the tool call or the reply."""

    decision: str
    action: str | None = None
    action_input: str | None = None
    reply: str | None = None


@dataclass
class ReActResponse:
    """Parsed steps of a response, in order."""

    steps: list[ReActStep] = field(default_factory=list)

    @property
    def tool_steps(self) -> list[ReActStep]:
        return [s for s in self.steps if s.action is not None]

    @property
    def decisions(self) -> list[str]:
        return [s.decision for s in self.steps]

    @property
    def reply(self) -> str | None:
        replies = [s.reply for s in self.steps if s.reply is not None]
        return replies[-1] if replies else None


def parse_react(text: str) -> ReActResponse:
    """Parse ``text`` into steps; lines that are not part of the format are ignored.

    ``Action`` / ``Action Input`` / ``AI`` lines belong to the latest ``Thought``; one that comes before
    any ``Thought`` opens a step with an empty decision (a malformed response).
    """
    response = ReActResponse()
    for raw in text.splitlines():
        match = _LINE.match(raw.strip())
        if match is None:
            continue
        if match["thought"]:
            response.steps.append(ReActStep(decision=match["decision"].strip()))
            continue
        if not response.steps:
            response.steps.append(ReActStep(decision=""))
        step = response.steps[-1]
        if match["action"] is not None:
            if step.action is not None:  # a second action without a thought: a new (malformed) step
                step = ReActStep(decision="")
                response.steps.append(step)
            step.action = match["action"].strip()
        elif match["input"] is not None:
            step.action_input = match["input"].strip()
        elif match["reply"] is not None:
            step.reply = match["reply"].strip()
    return response


def split_arguments(action_input: str) -> list[str]:
    """Comma-separated tool arguments, stripped (the GPT4Tools convention)."""
    return [part.strip() for part in action_input.split(",")]
