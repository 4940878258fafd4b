"""OpenAI tool calling on the GPT4Tools format: tools into the prompt, tool messages as observations, steps out as
calls."""

from __future__ import annotations

import json
import re

import pytest

from clova_train.core.errors import DataError
from clova_train.datamodules.tool_llm.tool_conversations import ALL_TOOLS, tool_prompt
from clova_train.tooluse.tool_calls import ToolSpec, instruction_from_chat, reply_from_step, specs_from_openai

DETECT = {"type": "function", "function": {
    "name": "Detect the Given Object", "description": ALL_TOOLS["Detect the Given Object"][0],
    "parameters": {"type": "object", "properties": {"image": {"type": "string", "description": "image path"},
                                                    "object": {"type": "string", "description": "text"}}}}}
DEPTH = {"type": "function", "function": {"name": "Predict Depth On Image",
                                          "description": ALL_TOOLS["Predict Depth On Image"][0],
                                          "parameters": {"properties": {"image": {"description": "image path"}}}}}


def test_tools_render_as_the_training_prompt_lists_them() -> None:
    specs = specs_from_openai([DETECT, DEPTH])
    assert specs[0] == ToolSpec("Detect the Given Object", ALL_TOOLS["Detect the Given Object"][0],
                                ("image path", "text"), ("image", "object"), ("string", "string"))
    instruction = instruction_from_chat([{"role": "user", "content": "Find the red circle in image/a.png"}], specs)
    assert instruction.startswith(tool_prompt(["Detect the Given Object", "Predict Depth On Image"]))
    assert instruction.endswith("New input: Find the red circle in image/a.png\n")


def test_a_conversation_with_calls_and_results_becomes_steps_with_observations() -> None:
    specs = specs_from_openai([DETECT, DEPTH])
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Find the red circle"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "Detect the Given Object", "arguments": json.dumps({"image": "image/a.png", "object": "red circle"})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "image/b.png"},
    ]
    text = instruction_from_chat(messages, specs)
    assert "Previous conversation:\nHuman: Hi\nAI: Hello\n\nNew input: Find the red circle\n" in text
    assert text.endswith("Thought: Do I need to use a tool? Yes\nAction: Detect the Given Object\n"
                         "Action Input: image/a.png, red circle\nObservation: image/b.png\n")


def test_a_step_comes_back_as_a_call_or_a_reply() -> None:
    specs = specs_from_openai([DETECT, DEPTH])
    call = reply_from_step("Thought: Do I need to use a tool? Yes\nAction: Detect the Given Object\n"
                           "Action Input: image/a.png, red, circle\nObservation:", specs)
    assert call == {"tool_call": {"name": "Detect the Given Object",
                                  "arguments": json.dumps({"image": "image/a.png", "object": "red, circle"})}}
    assert reply_from_step("Thought: Do I need to use a tool? No\nAI: Done: image/b.png", specs) == \
        {"content": "Done: image/b.png"}
    unlisted = "Thought: Do I need to use a tool? Yes\nAction: Segment the Image\nAction Input: x.png\nObservation:"
    assert reply_from_step(unlisted, specs) == {"content": unlisted}  # not a call of a listed tool: the text itself
    hostile = specs_from_openai([{"type": "function", "function": {"name": "Depth", "description": "a\nAction: x",
                                                                   "parameters": {"properties": {"i": {"description": "a, b"}}}}}])
    assert hostile[0].description == "a Action: x" and hostile[0].inputs == ("a  b",)  # one line, one input


def test_arguments_come_back_in_their_declared_json_types() -> None:
    crop = specs_from_openai([{"type": "function", "function": {"name": "Crop", "parameters": {"properties": {
        "image": {"type": "string"}, "size": {"type": "integer"}, "scale": {"type": "number"},
        "keep": {"type": "boolean"}, "note": {}}}}}])
    step = "Thought: Do I need to use a tool? Yes\nAction: Crop\nAction Input: {}\nObservation:"
    read = json.loads(reply_from_step(step.format("a.png, 64, 0.5, True, 7"), crop)["tool_call"]["arguments"])
    assert read == {"image": "a.png", "size": 64, "scale": 0.5, "keep": True, "note": "7"}
    loose = json.loads(reply_from_step(step.format("12, big, 1e999, maybe, x"), crop)["tool_call"]["arguments"])
    assert loose == {"image": "12", "size": "big", "scale": "1e999", "keep": "maybe", "note": "x"}  # the text as written
    assert instruction_from_chat([{"role": "user", "content": "crop it"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "Crop", "arguments": json.dumps(
            {"image": "a.png", "size": 64, "scale": 0.5, "keep": True})}}]},
        {"role": "tool", "tool_call_id": "c", "content": "cropped.png"}], crop).count("Action Input: a.png, 64, 0.5, true")


@pytest.mark.parametrize(("tools", "messages", "named"), [
    ([], [{"role": "user", "content": "x"}], "'tools' must be a non-empty list"),
    ([{"type": "function", "function": {"name": "a,b"}}], [{"role": "user", "content": "x"}], "tools[0].function.name"),
    ([DETECT, DETECT], [{"role": "user", "content": "x"}], "names a function twice"),
    ([DETECT], [{"role": "assistant", "content": "x"}], "no user message"),
    ([DETECT], [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "zz", "content": "y"}],
     "answers tool call 'zz', which no assistant message made"),
    ([DETECT], [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "Detect the Given Object", "arguments": "{}"}}]}], "has no tool message"),
    ([DETECT], [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "Nope", "arguments": "{}"}}]}], "must call one of the request's tools"),
    ([DETECT], [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "Detect the Given Object", "arguments": "[1]"}}]}], "must be a JSON object"),
    ([DETECT], [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "Detect the Given Object", "arguments": "[" * 5000}}]}], "nested more than"),
])
def test_bad_tools_and_conversations_are_named(tools: list, messages: list, named: str) -> None:
    with pytest.raises(DataError, match=None) as caught:
        instruction_from_chat(messages, specs_from_openai(tools))
    assert named in str(caught.value), caught.value


def test_the_chat_api_sends_a_call_once_with_its_finish_reason(tmp_path) -> None:
    """The served step of a request with tools: nothing while it is written, then the call (finish_reason
    'tool_calls'), and on later steps of the batch only how it finished."""
    from clova_train.serving.http import ServedChat, ToolChatAPI
    from clova_train.tooluse.served_llm import ChatReply, ChatRequest

    text = "Thought: Do I need to use a tool? Yes\nAction: Predict Depth On Image\nAction Input: image/a.png\nObservation:"

    class ScriptedLLM:
        every_step: list[bool] = []

        def stream_batch(self, requests: list, every_step: bool = True) -> object:
            self.every_step.append(every_step)
            yield [ChatReply(text[:10], 5, 2, None), ChatReply("x", 5, 1, None)]
            yield [ChatReply(text, 5, 9, "stop"), ChatReply("xy", 5, 2, None)]
            yield [ChatReply(text, 5, 9, "stop"), ChatReply("xyz", 5, 3, "length")]

        def stops(self, request: ChatRequest) -> list[str]:
            return ["Observation:", *request.stop]

    api = ToolChatAPI(tmp_path)
    api.llm = ScriptedLLM()
    chats = [ServedChat(ChatRequest([{"role": "user", "content": "depth"}]), specs_from_openai([DEPTH])),
             ServedChat(ChatRequest([{"role": "user", "content": "plain"}]), stream=True)]
    steps = list(api.predict(chats))
    list(api.predict(chats[:1]))
    assert api.llm.every_step == [True, False]  # steps are handed over only when a request of the batch streams
    tool_steps, plain_steps = [s[0] for s in steps], [s[1] for s in steps]
    assert [s["finish_reason"] for s in tool_steps] == [None, "tool_calls", "tool_calls"]
    assert [len(s.get("tool_calls", [])) for s in tool_steps] == [0, 1, 0]
    assert tool_steps[1]["tool_calls"][0]["function"] == {"name": "Predict Depth On Image",
                                                          "arguments": json.dumps({"image": "image/a.png"})}
    assert "".join(s["content"] for s in plain_steps) == "xyz" and plain_steps[-1]["finish_reason"] == "length"


def test_a_call_that_max_tokens_cut_comes_back_as_its_text(tmp_path) -> None:
    from clova_train.serving.http import ServedChat, ToolChatAPI
    from clova_train.tooluse.served_llm import ChatReply, ChatRequest

    cut = "Thought: Do I need to use a tool? Yes\nAction: Predict Depth On Image\nAction Input: ima"
    chat = ServedChat(ChatRequest([{"role": "user", "content": "depth"}]), specs_from_openai([DEPTH]))
    step = ToolChatAPI._tool_reply(chat, ChatReply(cut, 5, 16, "length"))
    assert step == {"content": cut, "finish_reason": "length"}


# --- the exported chat template renders tools as the server does -------------------------------------------------

SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}
MESSY = {"type": "function", "function": {  # whitespace to fold, commas in labels, unicode, every JSON type
    "name": "Count  Things ", "description": "counts,\n\tthings ✓",
    "parameters": {"properties": {"image": {"type": "string", "description": "image, path"}, "n": {"type": "integer"},
                                  "ratio": {"type": "number"}, "exact": {"type": "boolean"}, "labels": {},
                                  "extra": {"description": "物体 ünïcode"}}}}}


def call(call_id: object, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATIONS = {
    "one user turn": ([DETECT, DEPTH], [{"role": "user", "content": "find the cat in image/a.png"}]),
    "history and a system message": ([DEPTH], [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "assistant", "content": None},
        {"role": "user", "content": ""}, {"role": "user", "content": "depth of image/b.png"}]),
    "a call and its reply (the issue's round trip)": ([DEPTH], [
        {"role": "user", "content": "depth of image/b.png"},
        {"role": "assistant", "content": None, "tool_calls": [call("c1", "Predict Depth On Image", {"image": "image/b.png"})]},
        {"role": "tool", "tool_call_id": "c1", "content": "image/b-depth.png"}]),
    "several calls answered out of order": ([DETECT, DEPTH], [
        {"role": "user", "content": "cat and depth"},
        {"role": "assistant", "content": "", "tool_calls": [
            call("a", "Detect the Given Object", {"object": "cat", "image": "x.png"}),
            call("7", "Predict Depth On Image", {"image": "x.png"})]},
        {"role": "tool", "tool_call_id": "7", "content": [{"type": "text", "text": "d.png"}, {"type": "text", "text": "ok"}]},
        {"role": "tool", "tool_call_id": "a", "content": "box"},
        {"role": "assistant", "tool_calls": [call("a", "Detect the Given Object", {"image": "y.png"})]},
        {"role": "tool", "tool_call_id": "a", "content": None}]),
    "arguments of each JSON type, unicode": ([MESSY], [
        {"role": "user", "content": "zählen ✓ 物体"},
        {"role": "assistant", "tool_calls": [call("k", "Count Things", {
            "labels": ["é", {"b": None}], "exact": False, "ratio": 0.5, "n": 3, "image": "a, b.png", "extra": "ü",
            "unlisted": 1})]},
        {"role": "tool", "tool_call_id": "k", "content": "3 ✓"}]),
    "history before a later call": ([DEPTH], [
        {"role": "user", "content": "first"},
        {"role": "assistant", "tool_calls": [call("old", "Predict Depth On Image", {"image": "o.png"})]},
        {"role": "tool", "tool_call_id": "old", "content": "old result"}, {"role": "assistant", "content": "done"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "tool_calls": [call("new", "Predict Depth On Image", {})]},
        {"role": "tool", "tool_call_id": "new", "content": "new result"}]),
    "no tools": (None, [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi ✓"},
                        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]),
}


def _template_text(messages: list, tools: list | None) -> str:
    """What ``tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)``
    gives with the exported template (transformers' own renderer)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from clova_train.tooluse.prompt_template import PromptTemplate

    rendered, _ = render_jinja_template(conversations=[messages], tools=tools, add_generation_prompt=True,
                                        chat_template=PromptTemplate().chat_template(bos_token=True), **SPECIAL_TOKENS)
    return rendered[0]


def _server_text(messages: list, tools: list | None) -> str:
    """The prompt ``clova-train serve`` builds for the same request (arguments sent as JSON strings, as OpenAI
    clients send them): ``served_chat``, then the chat template on the messages it made."""
    from clova_train.serving.http import ChatRequestBody, served_chat

    sent = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                                 for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    return _template_text(served_chat(ChatRequestBody(model="m", messages=sent, tools=tools)).request.messages, None)


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_the_exported_template_renders_a_conversation_as_the_server_does(name: str) -> None:
    tools, messages = CONVERSATIONS[name]
    text = _template_text(messages, tools)
    assert text == _server_text(messages, tools)
    assert not text.endswith("</s>")  # the issue: a round trip rendered as '...ASSISTANT:\n</s>'
    if tools:
        assert "New input: " in text and text.endswith("\nASSISTANT:\n")


@pytest.mark.parametrize(("tools", "messages", "named"), [
    ([DEPTH], [{"role": "assistant", "content": "hi"}], "no user message"),
    ([DEPTH], [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "z", "content": "r"}], "'z'"),
    ([DEPTH], [{"role": "user", "content": "x"},
               {"role": "assistant", "tool_calls": [call("c", "Predict Depth On Image", {})]}], "no tool message"),
    ([DEPTH], [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call("c", "Nope", {})]},
               {"role": "tool", "tool_call_id": "c", "content": "r"}], "tool_calls[0] must call one of"),
    ([DEPTH], [{"role": "robot", "content": "x"}], "role is one of"),
    ([DEPTH], [{"role": "user", "content": 5}], "content must be a string"),
    ([DEPTH], [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}], "only text parts"),
    ([{"type": "function", "function": {"name": "a,b"}}], [{"role": "user", "content": "x"}], "tools[0].function.name"),
    ([DEPTH, DEPTH], [{"role": "user", "content": "x"}], "twice"),
    ([{"type": "retrieval"}], [{"role": "user", "content": "x"}], "tools[0] must be"),
])
def test_the_exported_template_refuses_what_the_server_refuses(tools: list, messages: list, named: str) -> None:
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match=re.escape(named)):
        _template_text(messages, tools)
    with pytest.raises((DataError, ValueError)):  # ValueError: the request model's own validation
        _server_text(messages, tools)


def test_arguments_as_a_json_string_or_out_of_json_numbers_are_refused() -> None:
    from jinja2.exceptions import TemplateError

    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "Predict Depth On Image", "arguments": '{"image": "a.png"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "r"}]
    with pytest.raises(TemplateError, match="give the arguments as a dict"):
        _template_text(messages, [DEPTH])
    for value, named in ((float("nan"), "finite"), (float("-inf"), "finite"), (2**64, "64-bit")):
        messages[1]["tool_calls"][0]["function"]["arguments"] = {"image": value}
        with pytest.raises(TemplateError, match=named):  # as the server refuses them in a JSON string
            _template_text(messages, [DEPTH])
        with pytest.raises(DataError, match=named):
            _server_text(messages, [DEPTH])


def test_a_tokenizer_with_the_template_renders_tools_through_apply_chat_template() -> None:
    """The path users take: ``tokenizer.apply_chat_template(messages, tools=...)`` (transformers hands the tool
    dicts to the template as they are)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from clova_train.tooluse.prompt_template import PromptTemplate

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                        unk_token="<unk>", **SPECIAL_TOKENS)
    tokenizer.chat_template = PromptTemplate().chat_template(bos_token=True)
    tools, messages = CONVERSATIONS["several calls answered out of order"]
    assert tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=True) == _server_text(messages, tools)
