"""The ``tools`` part of the exported chat template: the Jinja that turns an OpenAI conversation with tools into
the GPT4Tools instruction exactly as ``clova-train serve`` does
(:func:`clova_train.tooluse.tool_calls.instruction_from_chat`).

The Jinja is written from the same format strings as the Python (``tool_calls.TOOL_LINE``, ``FINISHED_STEP``, ...),
and checks what the server checks, with ``raise_exception`` (a tool reply that no call made, a call without its
reply, no user message, a bad tool). What a template cannot see: ``tool_choice`` (the server renders no tools for
``"none"``: leave ``tools`` out for that) and arguments given as a JSON string (transformers' templates take them
as a dict; vLLM parses them before rendering): a string is refused with a message saying so.
"""

from __future__ import annotations

import json
from string import Formatter

from clova_train.tooluse.tool_calls import (
    FINISHED_STEP,
    HISTORY_END,
    HISTORY_HEAD,
    HISTORY_LINE,
    MAX_NAME,
    MAX_TEXT,
    NAME_FORBIDDEN,
    NEW_INPUT,
    ROLES,
    SPEAKERS,
    TOOL_LINE,
    TOOL_LIST_HEAD,
    TOOL_LIST_TAIL,
)


def literal(text: str) -> str:
    """``text`` as a Jinja string literal."""
    return json.dumps(text, ensure_ascii=False)


def expression(format_string: str, **expressions: str) -> str:
    """A Jinja expression for ``format_string`` with each ``{field}`` replaced by the Jinja expression given for it."""
    parts = []
    for text, field, _, _ in Formatter().parse(format_string):
        if text:
            parts.append(literal(text))
        if field is not None:
            parts.append(f"(({expressions[field]})|string)")
    return " ~ ".join(parts) or literal("")


def emit(format_string: str, **expressions: str) -> str:
    """Jinja that prints ``format_string`` with each ``{field}`` replaced by the Jinja expression given for it."""
    return f"{{{{ {expression(format_string, **expressions)} }}}}"


def _refuse(message_expression: str) -> str:
    return f"{{{{ raise_exception({message_expression}) }}}}"


def _one_line(expression: str) -> str:
    """Jinja for ``tool_calls._one_line``: every whitespace run one space, at most MAX_TEXT characters."""
    return f"(' '.join((({expression})|string).split()))[:{MAX_TEXT}]"


# A message's text as the server reads it: None is empty, a list of text parts is joined by newlines.
MESSAGE_TEXT_MACRO = "".join([
    "{%- macro message_text(message, index) -%}",
    "{%- set content = message.get('content') -%}",
    "{%- if content is none -%}",
    "{%- elif content is string -%}{{ content }}",
    "{%- elif content is iterable and content is not mapping -%}",
    "{%- for part in content -%}",
    "{%- if part is not mapping or part.get('type') != 'text' or part.get('text') is not string -%}",
    _refuse("'messages[' ~ index ~ '].content: only text parts are supported'"),
    "{%- endif -%}",
    "{{ '\\n' if not loop.first }}{{ part.get('text') }}",
    "{%- endfor -%}",
    "{%- else -%}",
    _refuse("'messages[' ~ index ~ '].content must be a string'"),
    "{%- endif -%}",
    "{%- endmacro -%}",
])

_TOOL_SHAPE = "{'type': 'function', 'function': {'name', 'description', 'parameters'}}"


def _tools_checked() -> str:
    """Jinja that checks ``tools`` and collects ``tl.names``, ``tl.lines`` and ``tl.params`` (each tool's argument
    names in ``Action Input`` order), as ``specs_from_openai`` does."""
    forbidden = " or ".join(f"{literal(c)} in name" for c in NAME_FORBIDDEN)
    line = expression(TOOL_LINE, name="shown", description="described", inputs="tl.inputs|join(', ')")
    return "".join([
        "{%- if tools is string or tools is mapping or tools is not iterable -%}",
        _refuse(literal(f"'tools' must be a non-empty list of {_TOOL_SHAPE} objects")),
        "{%- endif -%}",
        "{%- set tl = namespace(names=[], lines='', params={}, inputs=[]) -%}",
        "{%- for tool in tools -%}",
        "{%- set where = 'tools[' ~ loop.index0 ~ ']' -%}",
        "{%- set function = tool.get('function') if tool is mapping else none -%}",
        "{%- if tool is not mapping or tool.get('type', 'function') != 'function' or function is not mapping -%}",
        _refuse(f"where ~ {literal(' must be ' + _TOOL_SHAPE)}"),
        "{%- endif -%}",
        "{%- set name = function.get('name') -%}",
        f"{{%- if name is not string or not name.strip() or name|length > {MAX_NAME} or {forbidden} "
        "or not name.isprintable() -%}",
        _refuse("where ~ " + literal(f".function.name must be a printable name of at most {MAX_NAME} characters "
                                     "without commas, brackets or colons")),
        "{%- endif -%}",
        "{%- set parameters = function.get('parameters') or {} -%}",
        "{%- set properties = parameters.get('properties', {}) if parameters is mapping else none -%}",
        "{%- if properties is not mapping -%}",
        _refuse(f"where ~ {literal('.function.parameters must be a JSON schema object with properties')}"),
        "{%- endif -%}",
        "{%- set tl.inputs = [] -%}",
        "{%- for key, schema in properties.items() -%}",
        "{%- set label = (schema.get('description') or key) if schema is mapping else key -%}",
        f"{{%- set tl.inputs = tl.inputs + [{_one_line('label')}.replace(',', ' ')] -%}}",
        "{%- endfor -%}",
        f"{{%- set shown = {_one_line('name')} -%}}",
        "{%- set described = " + _one_line("function.get('description') or ''") + " -%}",
        "{%- if shown in tl.names -%}",
        _refuse(literal("'tools' names a function twice")),
        "{%- endif -%}",
        "{%- set tl.names = tl.names + [shown] -%}",
        "{%- set tl.params = dict(tl.params, **{shown: properties.keys()|map('string')|list}) -%}",
        f"{{%- set tl.lines = tl.lines ~ {line} -%}}",
        "{%- endfor -%}",
    ])


def _conversation_checked() -> str:
    """Jinja that checks ``messages`` and collects ``cv.history``, ``cv.steps`` and ``cv.observations``, as
    ``instruction_from_chat`` does."""
    roles = literal(str(list(ROLES)))
    return "".join([
        "{%- if messages is string or messages is mapping or not messages -%}",
        _refuse(literal("'messages' must be a non-empty list")),
        "{%- endif -%}",
        "{%- set cv = namespace(last_user=-1, history=[], steps=[], pending={}, observations={}) -%}",
        "{%- for message in messages -%}",
        f"{{%- if message is not mapping or message.get('role') not in {list(ROLES)!r} -%}}",
        _refuse(f"'messages[' ~ loop.index0 ~ '] must be an object whose role is one of ' ~ {roles}"),
        "{%- endif -%}",
        "{%- if message['role'] == 'user' -%}{%- set cv.last_user = loop.index0 -%}{%- endif -%}",
        "{%- endfor -%}",
        "{%- if cv.last_user < 0 -%}",
        _refuse(literal("the conversation has no user message to answer")),
        "{%- endif -%}",
        "{%- for message in messages[:cv.last_user] -%}",
        "{%- set text = message_text(message, loop.index0) -%}",
        f"{{%- if message['role'] in {list(SPEAKERS)!r} and text -%}}",
        f"{{%- set cv.speaker = {literal(SPEAKERS['user'])} if message['role'] == 'user' else "
        f"{literal(SPEAKERS['assistant'])} -%}}",
        "{%- set cv.history = cv.history + [" + expression(HISTORY_LINE, speaker="cv.speaker", text="text") + "] -%}",
        "{%- endif -%}",
        "{%- endfor -%}",
        "{%- for message in messages[cv.last_user + 1:] -%}",
        "{%- set index = cv.last_user + 1 + loop.index0 -%}",
        "{%- if message['role'] == 'assistant' -%}",
        "{%- for call in message.get('tool_calls') or [] -%}",
        "{%- set where = 'messages[' ~ index ~ '].tool_calls[' ~ loop.index0 ~ ']' -%}",
        "{%- set function = call.get('function') if call is mapping else none -%}",
        "{%- if function is not mapping or function.get('name') not in tl.params -%}",
        _refuse("where ~ ' must call one of the request' ~ \"'\" ~ 's tools (' ~ tl.names|join(', ') ~ ')'"),
        "{%- endif -%}",
        "{%- set arguments = function.get('arguments') or {} -%}",
        "{%- if arguments is string -%}",
        _refuse("where ~ " + literal(".function.arguments is a JSON string: give the arguments as a dict "
                                     "(json.loads them), as chat templates take them")),
        "{%- elif arguments is not mapping -%}",
        _refuse(f"where ~ {literal('.function.arguments must be a JSON object')}"),
        "{%- endif -%}",
        "{%- set cv.values = [] -%}",
        "{%- for key in tl.params[function['name']] if key in arguments -%}",
        "{%- set value = arguments[key] -%}",
        "{%- if value is number and (value != value or value * 0 != 0) -%}",  # NaN, infinities: JSON has none
        _refuse("where ~ '.function.arguments: ' ~ key ~ ' = ' ~ value ~ ': must be a finite number'"),
        "{%- elif value is integer and (value < -(2 ** 63) or value >= 2 ** 64) -%}",
        _refuse("where ~ '.function.arguments: ' ~ key ~ ': must be an integer within the 64-bit range'"),
        "{%- endif -%}",
        "{%- set cv.values = cv.values + [value if value is string else value|tojson(ensure_ascii=true)] -%}",
        "{%- endfor -%}",
        "{%- set call_id = call.get('id', '')|string -%}",
        "{%- set cv.pending = dict(cv.pending, **{call_id: cv.steps|length}) -%}",
        "{%- set cv.steps = cv.steps + [[function['name'], cv.values|join(', ')]] -%}",
        "{%- endfor -%}",
        "{%- elif message['role'] == 'tool' -%}",
        "{%- set call_id = message.get('tool_call_id', '')|string -%}",
        "{%- set slot = cv.pending.get(call_id, -1) -%}",
        "{%- if slot < 0 -%}",
        _refuse("'messages[' ~ index ~ '] answers tool call ' ~ \"'\" ~ call_id ~ \"'\" ~ ', which no assistant message made'"),
        "{%- endif -%}",
        "{%- set cv.pending = dict(cv.pending, **{call_id: -1}) -%}",
        "{%- set cv.observations = dict(cv.observations, **{slot|string: message_text(message, index)}) -%}",
        "{%- endif -%}",
        "{%- endfor -%}",
        "{%- for step in cv.steps -%}",
        "{%- if (loop.index0|string) not in cv.observations -%}",
        _refuse("'the call to ' ~ \"'\" ~ step[0] ~ \"'\" ~ ' has no tool message with its result'"),
        "{%- endif -%}",
        "{%- endfor -%}",
    ])


def tools_checked() -> str:
    """Jinja, run before anything is printed, that checks ``tools`` and ``messages`` (``raise_exception`` naming
    what is wrong) and collects what :func:`instruction` prints."""
    return MESSAGE_TEXT_MACRO + _tools_checked() + _conversation_checked()


def instruction() -> str:
    """Jinja that prints the GPT4Tools instruction collected by :func:`tools_checked`."""
    return "".join([
        emit(TOOL_LIST_HEAD), "{{ tl.lines }}", emit(TOOL_LIST_TAIL, names="tl.names|join(', ')"),
        "{%- if cv.history -%}", emit(HISTORY_HEAD), "{{ cv.history|join('\\n') }}", emit(HISTORY_END),
        "{%- endif -%}",
        emit(NEW_INPUT, text="message_text(messages[cv.last_user], cv.last_user)"),
        "{%- for step in cv.steps -%}",
        emit(FINISHED_STEP, name="step[0]", arguments="step[1]", observation="cv.observations[loop.index0|string]"),
        "{%- endfor -%}",
    ])
