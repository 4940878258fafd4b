"""``clova-train serve`` over HTTP (LitServe) on loopback: prompt-tool and OpenAI-compatible chat endpoints,
checked against the in-process loaders, with a real HTTP client; and ``clova-train predict``."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from clova_train.cli import main
from clova_train.tools.prompt_server import PromptToolServer
from clova_train.tooluse.served_llm import ChatRequest, ServedToolLLM
from helpers.serving import free_port, serving

IMAGES = ["red/red_000.png", "purple/purple_001.png", "blue/blue_002.png"]


def post(url: str, body: object, timeout: float = 60) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


@pytest.fixture(scope="module")
def server(clip_export: Path, lora_export: Path, tmp_path_factory: pytest.TempPathFactory):
    with serving([str(clip_export), str(lora_export), "--max-batch-size", "4", "--batch-timeout", "0.2",
                  "--image-root", str(tmp_path_factory.getbasetemp())]) as (base, _):
        yield base


def test_classify_and_select_match_the_in_process_loader(server: str, clip_export: Path, concept_root: Path) -> None:
    local = PromptToolServer.from_export(clip_export)
    images = [str(concept_root / p) for p in IMAGES]
    for request in ({"images": images, "labels": ["red", "purple", "blue", "green"]}, {"images": images, "concept": "purple"}):
        status, reply = post(server + "/v1/clip", request)
        assert status == 200, reply
        expected = local.serve(request)
        assert reply.keys() == expected.keys()
        assert reply.get("labels") == expected.get("labels") and reply.get("index") == expected.get("index")
        np.testing.assert_allclose(reply["scores"], expected["scores"], atol=1e-5)


@pytest.mark.parametrize("body, message", [
    ({"images": ["/nonexistent.png"], "labels": ["red"]}, "'images'[0] names a file outside the server's --image-root"),
    ({"images": [], "labels": ["red"]}, "'images'"),
    ({"images": ["x.png"]}, "needs 'labels'"),
    (["not", "an", "object"], "JSON object"),
])
def test_bad_prompt_tool_requests_get_400_naming_the_field(server: str, body: object, message: str) -> None:
    status, reply = post(server + "/v1/clip", body)
    assert status == 400 and message in reply["error"]["message"], reply  # OpenAI's error shape


def test_chat_completions_match_the_in_process_model(server: str, lora_export: Path) -> None:
    llm = ServedToolLLM.from_export(lora_export)
    conversations = [[{"role": "user", "content": f"Describe image/{k}.png"}] for k in range(4)]
    expected = [r.text for r in llm.chat_batch([ChatRequest(m, max_tokens=12) for m in conversations])]

    def ask(messages: list) -> tuple[int, dict]:  # no temperature: greedy, as the in-process default
        return post(server + "/v1/chat/completions", {"model": str(lora_export), "messages": messages, "max_tokens": 12})

    with ThreadPoolExecutor(4) as pool:  # concurrent requests: batched by the server
        results = list(pool.map(ask, conversations))
    for (status, reply), text in zip(results, expected):
        assert status == 200, reply
        assert reply["object"] == "chat.completion"
        assert reply["choices"][0]["message"] == {"role": "assistant", "content": text, **{
            k: v for k, v in reply["choices"][0]["message"].items() if k not in ("role", "content")}}
        assert reply["usage"]["completion_tokens"] <= 12 and reply["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize("messages, message", [
    ([], "non-empty list"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}], "last message must be the user's"),
    ([{"role": "tool", "content": "hi"}], "messages[0]"),
])
def test_bad_chat_requests_get_400(server: str, messages: list, message: str) -> None:
    status, reply = post(server + "/v1/chat/completions", {"model": "", "messages": messages})
    assert status in (400, 422) and message in json.dumps(reply), reply


def test_a_chat_past_the_models_context_is_a_400_naming_both_numbers(server: str, lora_export: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt plus max_tokens over the context length: refused before any generation, over HTTP (by the server, a
    worker never sees it) and in process (ServedToolLLM checks what nobody checked before)."""
    from clova_train.core.errors import DataError

    served = ServedToolLLM.from_export(lora_export)
    context = served.budget.context
    assert context is not None and context == served.model.config.max_position_embeddings
    long = [{"role": "user", "content": "word " * (context + 10)}]
    status, reply = post(server + "/v1/chat/completions", {"model": "", "messages": long, "max_tokens": 5})
    assert status == 400 and f"more than the model's context of {context:,} tokens" in json.dumps(reply), reply
    assert "max_tokens is 5" in json.dumps(reply)
    fits = [{"role": "user", "content": "hello"}]
    prompt = served.budget.prompt_tokens(ChatRequest(messages=fits))
    status, reply = post(server + "/v1/chat/completions", {"model": "", "messages": fits,
                                                           "max_tokens": context - prompt + 1})
    assert status == 400 and f"{context + 1:,} is more than" in json.dumps(reply), reply
    monkeypatch.setattr(served.model, "generate", lambda *a, **k: pytest.fail("generated past the context"))
    with pytest.raises(DataError, match="the prompt is .* tokens and max_tokens is 3"):
        served.chat_batch([ChatRequest(messages=long, max_tokens=3)])
    with pytest.raises(DataError, match="more than the model's context"):
        next(served.stream_batch([ChatRequest(messages=long, max_tokens=3)]))


def test_the_official_sdk_sees_the_model_finish_reasons_and_errors(server: str, lora_export: Path) -> None:
    """As vLLM serves it: /v1/models lists the served name (the export path as given), another model is a 404 in
    OpenAI's error shape, a reply that max_tokens cut ends with finish_reason 'length', and a request that names no
    temperature is answered greedily (the same text twice)."""
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [str(lora_export)]
    messages = [{"role": "user", "content": "Describe image/7.png"}]
    cut = client.chat.completions.create(model=str(lora_export), messages=messages, max_tokens=2)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 2
    again = client.chat.completions.create(model=str(lora_export), messages=messages, max_tokens=2)
    assert again.choices[0].message.content == cut.choices[0].message.content
    with pytest.raises(openai.NotFoundError, match="does not exist: this server serves"):
        client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="'temperature' must be between 0 and 2"):
        client.chat.completions.create(model=str(lora_export), messages=messages, temperature=5)
    with pytest.raises(openai.BadRequestError, match="'max_tokens' must be at least 1"):
        client.chat.completions.create(model=str(lora_export), messages=messages, max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="last message must be the user's"):
        client.chat.completions.create(model=str(lora_export), max_tokens=2,
                                       messages=[*messages, {"role": "assistant", "content": "x"}])


def test_streaming_sends_the_reply_token_by_token(server: str, lora_export: Path) -> None:
    """stream=True: text/event-stream, one chunk per generated token (role first, finish_reason last), the chunks
    adding up to the reply a plain request gets, with its finish reason and token counts."""
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Describe image/3.png"}]
    plain = client.chat.completions.create(model=str(lora_export), messages=messages, max_tokens=8)
    chunks = list(client.chat.completions.create(model=str(lora_export), messages=messages, max_tokens=8, stream=True))
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(texts) == plain.choices[0].message.content
    assert len(texts) > 1  # not the whole text in one chunk
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1  # one completion
    request = urllib.request.Request(server + "/v1/chat/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"messages": messages, "max_tokens": 3, "stream": True}).encode())
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        assert response.read().decode().rstrip().endswith("data: [DONE]")


def test_a_batch_nobody_streams_is_handed_over_once_as_chat_batch_answers_it(lora_export: Path) -> None:
    """every_step=False (the server's path for plain requests): one hand-over per run of requests, the very replies
    chat_batch gives; every_step=True ends with the same replies after one hand-over per token."""
    served = ServedToolLLM.from_export(lora_export)
    requests = [ChatRequest(messages=[{"role": "user", "content": "Describe image/3.png"}], max_tokens=6),
                ChatRequest(messages=[{"role": "user", "content": "hello"}], max_tokens=3)]
    expected = served.chat_batch(requests)
    once = list(served.stream_batch(requests, every_step=False))
    assert once == [expected]
    stepwise = list(served.stream_batch(requests))
    assert stepwise[-1] == expected and len(stepwise) > max(r.completion_tokens for r in expected)


def test_an_abandoned_request_stops_at_the_next_step_and_leaves_its_batch_as_it_was(lora_export: Path) -> None:
    """A request whose ``abandoned`` says yes stops generating at that step, streamed or not; the other requests of
    its batch get the very replies they get alone."""
    served = ServedToolLLM.from_export(lora_export)
    keep = ChatRequest(messages=[{"role": "user", "content": "Describe image/3.png"}], max_tokens=12)
    asked = []

    def gone_after_two_steps() -> bool:
        asked.append(1)
        return len(asked) > 2

    left = ChatRequest(messages=[{"role": "user", "content": "hello"}], max_tokens=200, abandoned=gone_after_two_steps)
    steps = list(served.stream_batch([left]))  # one hand-over per step, then the final one
    assert len(steps) <= 4 and steps[-1][0].completion_tokens <= 3 and len(asked) == 3
    for every_step in (True, False):
        asked.clear()
        *_, (kept, _) = served.stream_batch([keep, left], every_step=every_step)
        assert kept == served.chat_batch([keep])[0] and len(asked) == 3  # asked until yes, then remembered


def _seconds(call) -> float:
    import time

    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def test_a_client_that_goes_away_frees_the_worker_at_once(server: str, lora_export: Path) -> None:
    """The official SDK closing a stream after its first chunk, and a plain request whose client gives up, stop their
    generation: the next request is answered at its usual latency, not after the rest of the abandoned 700-token
    reply."""
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)
    model, long_ask = str(lora_export), [{"role": "user", "content": "hello"}]

    def short() -> None:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Describe image/3.png"}],
                                       max_tokens=4)

    usual = min(_seconds(short) for _ in range(2))
    whole = {}  # a plain request is generated without a hand-over per token: many more tokens per second
    whole_seconds = _seconds(lambda: whole.update(reply=client.chat.completions.create(
        model=model, messages=long_ask, max_tokens=700, stop=[], temperature=0)))
    assert whole["reply"].usage.completion_tokens == 700, "the test needs a reply that runs to its budget"

    stream = client.chat.completions.create(model=model, messages=long_ask, max_tokens=700, stream=True)
    next(iter(stream))
    stream.close()
    after_stream = _seconds(short)

    with pytest.raises((TimeoutError, urllib.error.URLError)):  # the client gives up and closes its connection
        post(server + "/v1/chat/completions", {"model": model, "messages": long_ask, "max_tokens": 700}, timeout=0.5)
    after_plain = _seconds(short)
    # unfixed, the next request waited for the rest of the abandoned reply (2 cores: 1.5 s of a 1.5 s reply)
    limit = usual + (whole_seconds - usual) / 2
    assert max(after_stream, after_plain) < limit, (usual, whole_seconds, after_stream, after_plain)


def test_a_worker_that_cannot_load_its_export_stops_the_server_with_one_message(lora_export: Path, clip_export: Path,
                                                                                 tmp_path: Path) -> None:
    """The model is loaded once, by the server's worker; weights that fail there (a truncated safetensors file) end the
    whole server with exit code 2 and the export's one-line error, workers included, even beside a good export."""
    import shutil
    import subprocess
    import sys

    broken = tmp_path / "broken"
    shutil.copytree(lora_export, broken)
    for weights in (broken / "merged").glob("*.safetensors"):
        weights.write_bytes(weights.read_bytes()[:100])
    # beside a good export (the harder case: its worker loads fine and must be stopped too)
    done = subprocess.run([sys.executable, "-m", "clova_train", "serve", str(clip_export), str(broken), "--port",
                           str(free_port())], capture_output=True, text=True, timeout=300, start_new_session=True)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"clova-train: error: cannot load the LoRA export from '{broken}'" in done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def test_serve_refuses_a_missing_export_before_listening(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", str(tmp_path / "missing"), "--port", str(free_port())]) == 2
    assert "export directory not found" in capsys.readouterr().err


def test_predict_over_a_folder_and_a_jsonl(clip_export: Path, concept_root: Path, tmp_path: Path) -> None:
    local = PromptToolServer.from_export(clip_export)
    out = tmp_path / "preds.jsonl"
    assert main(["predict", str(clip_export), "--inputs", str(concept_root / "red"), "-o", str(out),
                 "--field", 'labels=["red", "purple", "green"]']) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    images = sorted((concept_root / "red").glob("*.png"))
    assert [line["input"]["images"] for line in lines] == [[str(p)] for p in images]
    for line in lines:
        alone = local.serve(line["input"])
        assert line["output"]["labels"] == alone["labels"]
        np.testing.assert_allclose(line["output"]["scores"], alone["scores"], atol=1e-5)

    requests = tmp_path / "requests.jsonl"
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes((concept_root / IMAGES[1]).read_bytes())
    requests.write_text(json.dumps({"images": ["imgs/a.png"], "concept": "purple"}) + "\n"
                        + json.dumps({"images": ["imgs/missing.png"], "concept": "purple"}) + "\n")
    assert main(["predict", str(clip_export), "--inputs", str(requests), "-o", str(out)]) == 1  # one input failed
    first, second = [json.loads(line) for line in out.read_text().splitlines()]
    alone = local.serve({"images": [str(tmp_path / "imgs" / "a.png")], "concept": "purple"})
    assert first["output"]["index"] == alone["index"]
    np.testing.assert_allclose(first["output"]["scores"], alone["scores"], atol=1e-5)
    assert "image not found" in second["error"] and "missing.png" in second["error"]


def test_predict_exits_non_zero_and_says_how_many_inputs_failed(clip_export: Path, concept_root: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    """A folder without the --field the tool's requests need: every input fails, the command says so and exits 1
    (each line still records its error)."""
    out = tmp_path / "preds.jsonl"
    assert main(["predict", str(clip_export), "--inputs", str(concept_root / "red"), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "every input failed" in err and "--field NAME=VALUE" in err and "labels" in err, err
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines and all("error" in line for line in lines)


@pytest.mark.parametrize("name", ["/etc/passwd", "../outside.png", "a/../../b.png", "", 3])
def test_clients_cannot_choose_where_the_server_writes(tmp_path: Path, name: object) -> None:
    from fastapi import HTTPException

    from clova_train.serving.http import served_output_path

    with pytest.raises(HTTPException) as caught:
        served_output_path(tmp_path, name)
    assert caught.value.status_code == 400 and "output" in caught.value.detail


def test_relative_outputs_land_under_the_output_dir(tmp_path: Path) -> None:
    from clova_train.serving.http import served_output_path

    assert served_output_path(tmp_path, "sub/out.png") == tmp_path.resolve() / "sub" / "out.png"


@pytest.mark.parametrize("line, message", [("{oops", "line 2 is not valid JSON"), ('["a"]', "line 2 must be a JSON object")])
def test_predict_names_the_jsonl_line_that_is_not_a_request(clip_export: Path, tmp_path: Path, line: str, message: str,
                                                            capsys: pytest.CaptureFixture) -> None:
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"images": ["a.png"], "concept": "red"}) + "\n" + line + "\n")
    assert main(["predict", str(clip_export), "--inputs", str(requests), "-o", str(tmp_path / "out.jsonl")]) == 1
    assert f"requests.jsonl {message}" in capsys.readouterr().err
    bad = json.loads((tmp_path / "out.jsonl").read_text().splitlines()[1])  # the other lines are still answered
    assert bad["line"] == 2 and f"requests.jsonl {message}" in bad["error"]


def test_tools_go_into_the_prompt_and_tool_messages_come_back_as_observations(server: str, lora_export: Path) -> None:
    """A request with tools is answered as the model answers the GPT4Tools instruction built from it: a call of a
    listed tool as tool_calls (finish_reason 'tool_calls'), anything else as content; a conversation that carries
    the call and a tool message with its result is accepted, streamed or not."""
    import openai

    from clova_train.tooluse.tool_calls import instruction_from_chat, reply_from_step, specs_from_openai

    tools = [{"type": "function", "function": {"name": "Detect the Given Object", "description": "Useful to find "
              "where a named object is in the image.", "parameters": {"type": "object", "properties": {
                  "image": {"type": "string", "description": "image path"},
                  "object": {"type": "string", "description": "text"}}}}}]
    call = {"id": "call_1", "type": "function", "function": {
        "name": "Detect the Given Object", "arguments": json.dumps({"image": "image/a.png", "object": "red circle"})}}
    first = [{"role": "user", "content": "Find the red circle in image/a.png"}]
    followed = [*first, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "image/b.png"}]
    llm = ServedToolLLM.from_export(lora_export)
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)
    for messages in (first, followed):
        instruction = instruction_from_chat(messages, specs_from_openai(tools))
        local = llm.chat_batch([ChatRequest([{"role": "user", "content": instruction}], max_tokens=16)])[0]
        expected = reply_from_step(local.text, specs_from_openai(tools))
        reply = client.chat.completions.create(model=str(lora_export), messages=messages, tools=tools, max_tokens=16)
        choice = reply.choices[0]
        if "tool_call" in expected:
            assert choice.finish_reason == "tool_calls"
            assert choice.message.tool_calls[0].function.name == expected["tool_call"]["name"]
            assert choice.message.tool_calls[0].function.arguments == expected["tool_call"]["arguments"]
        else:
            assert choice.message.content == expected["content"] and choice.finish_reason == local.finish_reason
        streamed = list(client.chat.completions.create(model=str(lora_export), messages=messages, tools=tools,
                                                       max_tokens=16, stream=True))
        assert streamed[-1].choices[0].finish_reason == choice.finish_reason
    forged = [*first, {"role": "tool", "tool_call_id": "nope", "content": "x"}]
    with pytest.raises(openai.BadRequestError, match="which no assistant message made"):
        client.chat.completions.create(model=str(lora_export), messages=forged, tools=tools, max_tokens=4)


def test_the_http_documentation_examples_run_against_a_live_server(clip_export: Path, lora_export: Path,
                                                                     concept_root: Path, tmp_path: Path) -> None:
    """Every curl line of docs/http-api.md for the CLIP, chat and model-list endpoints, as written (JSON with and
    without its header, data: URLs, multipart uploads, streaming, tools), with the images it names in the server's
    working directory; the other tools' requests are served in tests/tools/test_conformance.py."""
    import shutil
    import subprocess

    from helpers.common import REPO
    from helpers.docs import shell_commands, without_comment

    shutil.copyfile(concept_root / IMAGES[1], tmp_path / "a.png")
    shutil.copyfile(concept_root / IMAGES[0], tmp_path / "b.png")
    served = "checkpoints/quickstart_llm/export"
    commands = [without_comment(c) for c in shell_commands(REPO / "docs" / "http-api.md") if c.startswith("curl ")]
    live = [c for c in commands if any(p in c for p in ("/v1/clip", "/v1/chat/", "/v1/models"))]
    assert len(live) >= 9 and any(" -F " in c for c in live) and any("data:image" in c for c in live), live
    with serving([str(clip_export), str(lora_export), "--served-model-name", served, "--image-root", str(tmp_path)],
                 cwd=tmp_path) as (base, _):
        for command in live:
            run = subprocess.run(["bash", "-c", command.replace("localhost:8000", base.removeprefix("http://"))],
                                 cwd=tmp_path, capture_output=True, text=True, timeout=120)
            assert run.returncode == 0, (command, run.stderr)
            if '"stream": true' in command:
                events = [line.removeprefix("data: ") for line in run.stdout.splitlines() if line.startswith("data: ")]
                assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1]), run.stdout
                continue
            reply = json.loads(run.stdout)
            assert "error" not in reply, (command, reply)
            if "/v1/clip" in command:
                assert ("labels" in reply) != ("index" in reply), reply
            elif "/v1/models" in command:
                assert [m["id"] for m in reply["data"]] == [served]
            else:
                assert reply["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls"), reply


def test_a_chat_request_is_checked_once_on_its_way_to_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's spec checks a chat request (400 on a bad one) and hands the checked request to the worker's
    decode step, which renders and checks nothing again; the model's prompt builder takes it as it is."""
    from clova_train.serving import http
    from clova_train.tooluse import served_llm

    checks: list[str] = []
    check_messages, instruction_from_chat = served_llm.check_messages, http.instruction_from_chat
    monkeypatch.setattr(served_llm, "check_messages", lambda m: checks.append("messages") or check_messages(m))
    monkeypatch.setattr(http, "instruction_from_chat", lambda m, t: checks.append("tools") or instruction_from_chat(m, t))
    tool = {"type": "function", "function": {"name": "Detect", "description": "finds things",
                                             "parameters": {"type": "object", "properties": {"image": {"type": "string"}}}}}
    for body, expected in (({"messages": [{"role": "user", "content": "hi"}]}, ["messages"]),
                           ({"messages": [{"role": "user", "content": "find the cat in a.png"}], "tools": [tool]},
                            ["tools", "messages"])):
        request = http.ChatRequestBody(**body)
        checks.clear()
        request._served = http.served_chat(request)  # what ToolChatSpec.chat_completion does
        api = http.ToolChatAPI.__new__(http.ToolChatAPI)
        api.abandoned = None
        decoded = api.decode_request(request)
        assert decoded is request._served and checks == expected, checks
    with pytest.raises(served_llm.DataError, match="the last message must be the user's"):
        http.served_chat(http.ChatRequestBody(messages=[{"role": "assistant", "content": "hi"}]))


def _stopped(process, signals: tuple[int, ...], within: float = 60.0) -> tuple[int, str, float]:
    """Send ``signals`` to the server's own process (as ``kill -TERM $PID``, systemd or Docker do, not to its group);
    its exit code, output and how long it took."""
    import os
    import time

    started = time.monotonic()
    for number in signals:
        os.kill(process.pid, number)
        time.sleep(0.2)
    code = process.wait(timeout=within)
    return code, process.stdout.read(), time.monotonic() - started


def _port_is_free(base: str) -> bool:
    import socket

    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", int(base.rsplit(":", 1)[1])))
        except OSError:
            return False
    return True


@pytest.mark.slow
def test_a_server_stops_on_sigterm_and_sigint_with_its_workers_and_frees_its_port(clip_export: Path,
                                                                                 lora_export: Path) -> None:
    """Each export kind, with and without a key, twice in a row on the same port: the first signal stops the server
    and every process it started within the grace period, exit code 0, and the port takes the next server."""
    import signal
    import time

    from helpers.serving import process_group, start_server

    port = free_port()
    for export, key, number in ((clip_export, None, signal.SIGTERM), (clip_export, "k3y", signal.SIGINT),
                                (lora_export, None, signal.SIGTERM)):
        base, process = start_server([str(export), *(["--api-key", key] if key else [])], port=port)
        assert len(process_group(process.pid)) >= 3  # the server, its API server and a worker (and LitServe's manager)
        code, output, seconds = _stopped(process, (number,))
        assert code == 0 and f"stopped ({signal.Signals(number).name})" in output, output[-2000:]
        deadline = time.monotonic() + 10
        while process_group(process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert process_group(process.pid) == [], "a worker outlived its server"
        assert _port_is_free(base) and seconds < 45, seconds


@pytest.mark.slow
def test_a_second_signal_forces_the_stop_and_a_stream_in_flight_ends(lora_export: Path) -> None:
    """A client streaming a long reply when the server is told to stop gets an end (the rest of its reply or a closed
    connection), never a hang; a second signal ends the server at once."""
    import signal
    import threading

    import openai

    from helpers.serving import process_group, start_server

    base, process = start_server([str(lora_export)])
    ended: list[str] = []

    def stream() -> None:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        try:
            for _ in client.chat.completions.create(model=str(lora_export), stream=True, max_tokens=700,
                                                    messages=[{"role": "user", "content": "hello"}]):
                pass
            ended.append("finished")
        except Exception as error:  # the connection closed under it: an end, not a hang
            ended.append(type(error).__name__)

    reader = threading.Thread(target=stream)
    reader.start()
    import time

    time.sleep(1.0)
    code, output, seconds = _stopped(process, (signal.SIGTERM, signal.SIGTERM), within=30)
    reader.join(timeout=60)
    assert ended and not reader.is_alive(), "the streaming client hung"
    assert code == 128 + signal.SIGTERM and seconds < 15, (code, seconds, output[-2000:])
    time.sleep(1.0)
    assert process_group(process.pid) == []


def test_sampling_parameters_are_honoured_or_refused_through_the_official_sdk(server: str, lora_export: Path) -> None:
    """Without a seed, sampling draws fresh randomness (a seed repeats a reply); top_p is honoured (a vanishing
    nucleus draws the same reply whatever the seed); text content parts are read as the text; penalties, log probabilities, a JSON
    response format and non-text parts are a 400 naming the parameter, never accepted and ignored."""
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)
    hello = [{"role": "user", "content": "hello"}]

    def reply(**options) -> str:
        options = {"model": str(lora_export), "messages": hello, "max_tokens": 12, **options}
        return client.chat.completions.create(**options).choices[0].message.content

    unseeded = {reply(temperature=1.0) for _ in range(3)}
    assert len(unseeded) > 1, unseeded
    assert reply(temperature=1.0, seed=7) == reply(temperature=1.0, seed=7)
    narrow = {reply(temperature=1.0, top_p=1e-9, seed=seed) for seed in (1, 2, 3)}
    assert len(narrow) == 1, narrow  # a one-token nucleus: every seed draws the same reply
    greedy = reply()
    assert reply(messages=[{"role": "user", "content": [{"type": "text", "text": "hello"}]}]) == greedy
    for options, named in (({"presence_penalty": 0.5}, "presence_penalty"), ({"frequency_penalty": 1.0},
                           "frequency_penalty"), ({"logprobs": True}, "logprobs"),
                           ({"logprobs": True, "top_logprobs": 2}, "top_logprobs"),
                           ({"response_format": {"type": "json_object"}}, "response_format"), ({"top_p": 0}, "top_p"),
                           ({"messages": [{"role": "user", "content": [
                               {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]},
                            "messages[0].content")):
        with pytest.raises(openai.BadRequestError, match=named.replace("[", r"\[").replace("]", r"\]")):
            reply(**options)


def test_stop_strings_end_the_reply_without_being_part_of_it_streamed_or_not(server: str, lora_export: Path) -> None:
    """As OpenAI and vLLM answer: the text before the first stop string, finish_reason stop; a stream sends exactly
    that text (the start of a stop string is held back until the next tokens say whether it completes)."""
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)
    options = {"model": str(lora_export), "messages": [{"role": "user", "content": "Describe image/3.png"}],
               "max_tokens": 24, "temperature": 0}
    whole = client.chat.completions.create(**options).choices[0].message.content
    assert len(whole.strip()) > 6, whole
    middle = len(whole) // 2
    stop = whole[middle:middle + 4]
    before = whole[: whole.find(stop)]
    plain = client.chat.completions.create(**options, stop=[stop, "never said"]).choices[0]
    assert (plain.message.content, plain.finish_reason) == (before, "stop")
    chunks = list(client.chat.completions.create(**options, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == before
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_stop_strings_start_is_held_back_until_it_is_known() -> None:
    from clova_train.tooluse.served_llm import pending_stop

    stops = ["Observation:", "\n\nHuman"]
    assert pending_stop("Action Input: a.png\nObserv", stops) == len("Observ")
    assert pending_stop("text\n", stops) == 1 and pending_stop("text\n\nHum", stops) == 5
    assert pending_stop("an Obs ervation", stops) == 0 and pending_stop("", stops) == 0


def test_the_default_temperature_is_the_exports_own(tmp_path: Path, lora_export: Path) -> None:
    """vLLM's rule: the merged model's generation_config.json (greedy when it does not sample), else serving.json,
    else 1.0; the exports this package writes are greedy, as their runs were evaluated."""
    from clova_train.tooluse.served_llm import default_temperature

    assert default_temperature(lora_export) == 0.0
    merged = tmp_path / "sampling" / "merged"
    merged.mkdir(parents=True)
    (merged / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6}))
    assert default_temperature(tmp_path / "sampling") == 0.6
    (merged / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert default_temperature(tmp_path / "sampling") == 0.0
    (tmp_path / "bare" / "adapter").mkdir(parents=True)
    assert default_temperature(tmp_path / "bare") == 1.0
