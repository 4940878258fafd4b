"""OpenAI tool calling on a GPT4Tools (ReAct) model: the request's tools go into the prompt, the model's
``Action:`` / ``Action Input:`` come back as ``tool_calls``, and ``tool`` messages are fed back as observations.

A request's ``tools`` (``{"type": "function", "function": {"name", "description", "parameters"}}``) become the
GPT4Tools tool list (``> Name: description Input: a, b.``, the format the model was trained on; each input is the
parameter's description, or its name). The conversation becomes one GPT4Tools instruction:

* the user and assistant turns before the last user message: ``Previous conversation:`` (``Human:`` / ``AI:``);
* the last user message: ``New input:``;
* each assistant tool call after it, with the content of the ``tool`` message that answers it: a finished step
  (``Thought: ... Yes`` / ``Action:`` / ``Action Input:`` / ``Observation: <content>``).

The model's next step is then either a call (``Action: <listed tool>``, its comma-separated ``Action Input``
mapped onto the parameters in order, as a JSON ``arguments`` object) or a reply (``AI: ...``, the content).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from clova_train.core.errors import DataError
from clova_train.core.safe_files import ReadLimits, parse_json
from clova_train.tooluse.react import THOUGHT_PREFIX, parse_react, split_arguments

ROLES = ("system", "user", "assistant", "tool")
MAX_TEXT = 1000  # characters of a tool's description or input label in the prompt


@dataclass(frozen=True)
class ToolSpec:
    """One tool as the model sees it: its name, what it is useful for, and its inputs in ``Action Input`` order."""

    name: str
    description: str
    inputs: tuple[str, ...]
    parameters: tuple[str, ...] = ()  # the JSON argument names (OpenAI tools), in the same order as ``inputs``
    types: tuple[str, ...] = ()  # each parameter's JSON schema type ("string", "integer", ...), "" when unstated


# The pieces of a GPT4Tools instruction, as format strings: the Python below and the exported chat template
# (tool_chat_template.py) are both written from these, so that the two render the same text.
TOOL_LIST_HEAD = ("GPT4Tools is a visual assistant that can use tools to look at and edit images.\n\nTOOLS:\n"
                  "GPT4Tools has access to the following tools:\n\n")
TOOL_LINE = "> {name}: {description} Input: {inputs}.\n"
TOOL_LIST_TAIL = ("\nTo use a tool, use this format:\n" + THOUGHT_PREFIX + " Yes\n"
                  "Action: the tool to use, one of [{names}]\nAction Input: the input to the tool\n"
                  "Observation: the result of the tool\n\nTo reply without a tool, use this format:\n"
                  + THOUGHT_PREFIX + " No\nAI: your reply\n")
HISTORY_HEAD = "Previous conversation:\n"
HISTORY_LINE = "{speaker}: {text}"  # lines joined by newlines, then HISTORY_END
HISTORY_END = "\n\n"
SPEAKERS = {"user": "Human", "assistant": "AI"}
NEW_INPUT = "New input: {text}\n"
FINISHED_STEP = THOUGHT_PREFIX + " Yes\nAction: {name}\nAction Input: {arguments}\nObservation: {observation}\n"
NAME_FORBIDDEN = ",[]:"  # characters a tool name cannot hold (they would break the Action line and the list)
MAX_NAME = 64


def tool_list_prompt(tools: Sequence[ToolSpec]) -> str:
    """The GPT4Tools prefix of an instruction: the role, the tool list and the format rules."""
    lines = "".join(TOOL_LINE.format(name=t.name, description=t.description, inputs=", ".join(t.inputs))
                    for t in tools)
    return TOOL_LIST_HEAD + lines + TOOL_LIST_TAIL.format(names=", ".join(t.name for t in tools))


def specs_from_openai(tools: Any) -> list[ToolSpec]:
    """The request's ``tools`` as :class:`ToolSpec` s, or a :class:`DataError` naming the entry at fault."""
    if not isinstance(tools, list) or not tools:
        raise DataError("'tools' must be a non-empty list of {'type': 'function', 'function': {...}} objects")
    specs = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise DataError(f"{where} must be {{'type': 'function', 'function': {{'name', 'description', 'parameters'}}}}")
        name = function.get("name")
        if (not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME or any(c in name for c in NAME_FORBIDDEN)
                or not name.isprintable()):
            raise DataError(f"{where}.function.name must be a printable name of at most 64 characters without "
                            "commas, brackets or colons")
        parameters = function.get("parameters") or {}
        properties = parameters.get("properties", {}) if isinstance(parameters, dict) else None
        if not isinstance(properties, dict):
            raise DataError(f"{where}.function.parameters must be a JSON schema object with 'properties'")
        inputs = tuple(_one_line(p.get("description") or key if isinstance(p, dict) else key).replace(",", " ")
                       for key, p in properties.items())
        types = tuple(str(p.get("type", "")) if isinstance(p, dict) and isinstance(p.get("type", ""), str) else ""
                      for p in properties.values())
        specs.append(ToolSpec(_one_line(name), _one_line(function.get("description") or ""), inputs,
                              tuple(str(key) for key in properties), types))
    if len({s.name for s in specs}) != len(specs):
        raise DataError("'tools' names a function twice")
    return specs


def _one_line(text: Any) -> str:
    """``text`` with every run of whitespace (newlines included) one space: a tool's line stays one line."""
    return " ".join(str(text).split())[:MAX_TEXT]


def _text(message: dict[str, Any], index: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, list):  # OpenAI's content parts: the text ones
        return "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")
    if not isinstance(content, str):
        raise DataError(f"messages[{index}].content must be a string")
    return content


ARGUMENT_LIMITS = ReadLimits(max_bytes=1 << 20, max_depth=16)


def _arguments_text(call: Any, specs: dict[str, ToolSpec], where: str) -> tuple[str, str]:
    """(tool name, the ``Action Input`` line) of an assistant's tool call."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or function.get("name") not in specs:
        raise DataError(f"{where} must call one of the request's tools ({', '.join(specs)})")
    spec = specs[function["name"]]
    text = function.get("arguments") or "{}"
    if not isinstance(text, str):
        raise DataError(f"{where}.function.arguments must be a JSON object written as a string")
    arguments = parse_json(text, f"{where}.function.arguments", ARGUMENT_LIMITS, finite_only=True)
    if not isinstance(arguments, dict):
        raise DataError(f"{where}.function.arguments must be a JSON object")
    values = [v if isinstance(v, str) else json.dumps(v) for p in spec.parameters if p in arguments
              for v in [arguments[p]]]
    return spec.name, ", ".join(values)


def instruction_from_chat(messages: Any, tools: Sequence[ToolSpec]) -> str:
    """The GPT4Tools instruction for an OpenAI conversation with tools (module docstring), or a :class:`DataError`
    naming the message at fault."""
    if not isinstance(messages, list) or not messages:
        raise DataError("'messages' must be a non-empty list")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise DataError(f"messages[{index}] must be an object whose role is one of {list(ROLES)}")
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise DataError("the conversation has no user message to answer")
    last_user = users[-1]
    history = [HISTORY_LINE.format(speaker=SPEAKERS[m["role"]], text=_text(m, i))
               for i, m in enumerate(messages[:last_user]) if m["role"] in ("user", "assistant") and _text(m, i)]
    specs = {t.name: t for t in tools}
    steps, pending = [], {}
    for index, message in enumerate(messages[last_user + 1:], last_user + 1):
        if message["role"] == "assistant":
            for k, call in enumerate(message.get("tool_calls") or []):
                name, arguments = _arguments_text(call, specs, f"messages[{index}].tool_calls[{k}]")
                pending[str(call.get("id", ""))] = len(steps)
                steps.append([name, arguments, None])
        elif message["role"] == "tool":
            call_id = str(message.get("tool_call_id", ""))
            slot = pending.pop(call_id, None)
            if slot is None:
                raise DataError(f"messages[{index}] answers tool call {call_id!r}, which no assistant message made")
            steps[slot][2] = _text(message, index)
    unanswered = [name for name, _, observation in steps if observation is None]
    if unanswered:
        raise DataError(f"the call to {unanswered[0]!r} has no tool message with its result")
    text = tool_list_prompt(tools)
    if history:
        text += HISTORY_HEAD + "\n".join(history) + HISTORY_END
    text += NEW_INPUT.format(text=_text(messages[last_user], last_user))
    for name, arguments, observation in steps:
        text += FINISHED_STEP.format(name=name, arguments=arguments, observation=observation)
    return text


def typed_argument(value: str, kind: str) -> Any:
    """``value`` (text the model wrote) as the parameter's declared JSON type when it reads as one: an integer,
    a number or a boolean; otherwise, and for strings or undeclared types, the text itself."""
    text = value.strip()
    try:
        if kind == "integer" and re.fullmatch(r"[+-]?\d{1,18}", text):
            return int(text)
        if kind == "number" and re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d{1,3})?", text):
            number = float(text)
            return number if math.isfinite(number) else value
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
    except ValueError:
        pass
    return value


def reply_from_step(text: str, tools: Sequence[ToolSpec]) -> dict[str, Any]:
    """The model's step as an OpenAI reply: ``{"tool_call": {"name", "arguments"}}`` for a call of a listed tool,
    else ``{"content": <the AI: reply, or the text itself when the model wrote neither>}``."""
    steps = parse_react(text).steps
    step = steps[0] if steps else None
    specs = {t.name: t for t in tools}
    if step is not None and step.decision == "Yes" and step.action in specs:
        spec = specs[step.action]
        values = split_arguments(step.action_input or "") if step.action_input else []
        keys = list(spec.parameters)
        if len(values) > len(keys) and keys:  # more values than parameters: the rest belongs to the last one
            values = [*values[: len(keys) - 1], ", ".join(values[len(keys) - 1:])]
        types = spec.types or ("",) * len(keys)
        arguments = {key: typed_argument(value, kind) for key, value, kind in zip(keys, values, types)}
        return {"tool_call": {"name": spec.name, "arguments": json.dumps(arguments)}}
    if step is not None and step.reply is not None:
        return {"content": step.reply}
    return {"content": text}
