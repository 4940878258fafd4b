"""``clova-train serve EXPORT [EXPORT ...]``: HTTP serving of exports on LitServe.

Endpoints (one per export; a server can hold several exports of different kinds):

* prompt tools: ``POST /v1/<tool>`` (``/v1/clip``, ``/v1/blip_vqa``, ``/v1/owlvit_loc``, ...) with the JSON
  request the tool's ``serve_request`` takes (CLIP: ``{"images": [...], "labels": [...]}`` for CLASSIFY,
  ``{"images": [...], "concept": c}`` for SELECT), answered with the prompt ensemble;
* a LoRA tool-LLM export: ``POST /v1/chat/completions``, OpenAI-compatible (LitServe's ``OpenAISpec``),
  prompts formatted by the export's chat template, greedy unless the request sets a ``temperature`` (LitServe's
  request default of 0.7 is not passed on), stopping at the step boundary, ``finish_reason`` ``length`` when
  ``max_tokens`` cut the reply; the request's ``model`` must be empty or the served name (``--served-model-name``,
  default: the export path as given, as vLLM names a model by its path; 404 otherwise), which ``GET /v1/models``
  lists; each row of a batch stops at its own stop string or token limit;
  ``stream: true`` answers with server-sent events, one per generated token; a request's ``tools`` are rendered
  into the GPT4Tools prompt, the model's ``Action:`` / ``Action Input:`` come back as ``tool_calls``
  (``finish_reason`` ``tool_calls``) and ``tool`` messages are fed back as observations
  (:mod:`clova_train.tooluse.tool_calls`); requests, streamed or not, are batched (``max_batch_size`` /
  ``batch_timeout``) into one left-padded ``generate`` run with a streamer, whose steps go to LitServe token by token
  only when a request of the batch streams;
* a transformers depth-estimation model directory (no export needed; HYDRA's ``compute_depth``): ``POST /v1/depth``
  with ``{"image": ..., "boxes": [[x0, y0, x1, y1], ...]}`` (pixels, y from the top), answered with the median depth
  inside each box (of the whole image without boxes) and ``larger_is_nearer`` (:mod:`clova_train.tools.depth`);
* ``GET /health`` and ``GET /info`` (LitServe's).

Every request passes :class:`~clova_train.serving.guard.RequestGuard` first (API key, body size counted after
decompression, one safe JSON parse, list lengths), and every refusal or error is answered in OpenAI's error shape
(``{"error": {"message", "type", "param", "code"}}``) with a 4xx status naming the field; a bad request never
reaches the model and never stops the server. Prompt-tool requests are served one at a time (each request already
holds a batch of images). Images come as ``data:`` URLs or multipart uploads (written to a private temporary
directory for the request, :mod:`clova_train.serving.data_urls`; formats limited to common image ones). A name of a
file on the server's disk (in any image field: ``image``, ``images``, ``mask``) is refused unless the operator gave
``--image-root DIR``, and then read only when it lies under that folder (symlinks resolved); a name outside it is
refused from its text alone, before the file system is asked about it, so neither the answer nor its timing tells a
client whether a file outside the root exists (:func:`~clova_train.tools.data_urls.confined_server_paths`). Under the
root, a file that is missing, unreadable, not a regular file (a FIFO is never opened for reading), not an image or too
large gets one and the same answer. Files a tool writes (REPLACE's ``output``) go under ``--output-dir`` (symlinks
resolved), never where the client says. A request's images together may hold at most ``max_request_pixels`` (read
from their headers before any is decoded), so a small body of tiny-file, huge-canvas images cannot buy minutes of
decoding.

Resources: uvicorn runs with :mod:`clova_train.serving.connections`' protocol (a cap on connections below the
open-file limit, which is raised to its hard limit at start; header and body deadlines; the connection that waited
longest for its headers closed when a new one needs its place), and the request guard bounds the request bodies held
at once (``max_inflight_body_bytes``, 503 beyond), so good requests are answered while a thousand slow or idle
connections are open.
"""

# No ``from __future__ import annotations`` here: LitServe and FastAPI read these signatures' annotations as
# objects (a string annotation on ``decode_request`` would make LitServe queue the raw request object).

import asyncio
import functools
import json
import logging
import os
import secrets
import signal
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import litserve as ls
from fastapi import BackgroundTasks, HTTPException, Request
from pydantic import PrivateAttr
from litserve.specs.openai import ChatCompletionRequest, OpenAISpec
from litserve.utils import LitAPIStatus, WorkerSetupStatus, azip

from clova_train.core.errors import ClovaTrainError, DataError, ExportError
from clova_train.core.run_manifest import read_run_manifest
from clova_train.serving.abandoned import AbandonedRequests
from clova_train.serving.connections import ConnectionLimits, bounded_protocol, raise_open_file_limit
from clova_train.serving.guard import RequestGuard, RequestLimits, error_body, install_error_handlers
from clova_train.serving.stop_signals import stop_children, stop_on_signals
from clova_train.tooluse.served_llm import ChatRequest, ContextBudget, default_temperature, pending_stop
from clova_train.tooluse.tool_calls import ToolSpec, instruction_from_chat, reply_from_step, specs_from_openai


def export_kind(directory: Path) -> str:
    """``"lora"`` or ``"prompt_tool"`` for an export (or run) directory, ``"depth"`` for a transformers depth-estimation
    model directory (its config.json's ``model_type`` read, no weights loaded), or an :class:`ExportError`."""
    from clova_train.tools.depth import depth_model_type

    if not directory.is_dir():
        raise ExportError(f"export directory not found: {directory}")
    try:
        manifest = read_run_manifest(directory)
    except DataError as err:
        if depth_model_type(directory) is not None:
            return "depth"
        raise ExportError(f"{directory} is not an export: {err}") from None
    if manifest.kind == "lora":
        return "lora"
    if manifest.kind == "prompt_tuning":
        return "prompt_tool"
    raise ExportError(f"{directory} holds a {manifest.kind} {'export' if manifest.exported else 'run'}: "
                      "'clova-train serve' serves prompt-tool and LoRA exports")


MAX_OUTPUT_PART_BYTES = 128  # the atomic writer's temporary adds host, pid and more to the name (255 at most)
MAX_OUTPUT_BYTES = 1024


def served_output_path(output_dir: Path, name: object) -> Path:
    """Where a request's ``output`` file goes: a relative path inside ``output_dir`` (a client never chooses
    where on the server's disk a file is written), naming a file that can be written there."""
    if not isinstance(name, str) or not name.strip():
        raise HTTPException(400, "'output' must be a file name (written under the server's --output-dir)")
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts or "\x00" in name:
        raise HTTPException(400, f"'output' must be a relative path without '..' (it is written under the server's --output-dir), got {name!r}")
    _check_output_lengths(name, relative)
    root = output_dir.resolve()
    target = root / relative
    if not Path(os.path.realpath(target)).is_relative_to(root):  # a symlink inside --output-dir pointing out of it
        raise HTTPException(400, f"'output' {name!r} leads outside the server's --output-dir (through a symbolic link)")
    _check_output_place(name, root, relative)
    return target


def _check_output_lengths(name: str, relative: Path) -> None:
    """A name the file system can hold: each part at most :data:`MAX_OUTPUT_PART_BYTES` (UTF-8), the whole at most
    :data:`MAX_OUTPUT_BYTES`."""
    try:
        sizes = [len(part.encode("utf-8")) for part in relative.parts]
    except UnicodeEncodeError:
        raise HTTPException(400, f"'output' {name[:60]!r} is not well-formed text") from None
    if not sizes:
        raise HTTPException(400, f"'output' {name!r} names the server's --output-dir itself, not a file in it")
    if max(sizes) > MAX_OUTPUT_PART_BYTES or sum(sizes) + len(sizes) > MAX_OUTPUT_BYTES:
        raise HTTPException(400, f"'output' {name[:60]!r}{'...' if len(name) > 60 else ''} is too long: each part of "
                                 f"the path may be at most {MAX_OUTPUT_PART_BYTES} bytes, the whole path "
                                 f"{MAX_OUTPUT_BYTES}")


def _check_output_place(name: str, root: Path, relative: Path) -> None:
    """The folders on the way to ``relative`` are folders (or do not exist yet) and it is not one itself."""
    place = root
    try:
        for part in relative.parts[:-1]:
            place = place / part
            if place.exists() and not place.is_dir():
                raise HTTPException(400, f"'output' {name!r} cannot be written: {part!r} is a file, not a folder")
        if (root / relative).is_dir():
            raise HTTPException(400, f"'output' {name!r} is a folder on the server, not a file name")
    except OSError as err:  # a folder on the way the server may not search
        raise HTTPException(400, f"'output' {name!r} cannot be written: {err.strerror}") from None


def unreadable_image_message(name: str, max_pixels: int) -> str:
    """The one answer to every image the server cannot use, whatever the reason (missing, unreadable, FIFO,
    directory, not an image, too large): a client learns nothing about which server files exist."""
    return (f"image {name!r} cannot be used: there is no readable image file of at most {max_pixels:,} pixels by "
            "that name on the server")


@contextmanager
def reported_setup(report: Optional[Path]) -> Iterator[None]:
    """A worker's model load: a failure is written to ``report`` (one line, for the parent to print) and LitServe's
    own traceback of it is silenced; this worker is ending and the parent stops the server."""
    try:
        yield
    except Exception as err:
        if report is not None:
            report.write_text(str(err) if isinstance(err, ClovaTrainError) else f"{type(err).__name__}: {err}",
                              encoding="utf-8")
            logging.getLogger("litserve").setLevel(logging.CRITICAL)
        raise


class PromptToolAPI(ls.LitAPI):
    """``POST /v1/<tool>``: one exported prompt tool with its pool.

    Args:
        export: export directory.
        tool_name: the tool's name (the endpoint's last part).
        top_k: ensemble only the k most similar stored prompts (default: the tool's).
        base_model: frozen model directory overriding the export's.
        output_dir: where tools that write files (REPLACE) put a request's ``output``.
        max_image_pixels: largest image decoded (width x height, read from the header before any pixel).
        max_request_pixels: most pixels of all a request's images together (read from their headers).
        image_root: the folder whose image files clients may name (``None``: no server file is read for a client).
        margins: served margins overriding the ones the export carries (``classify_margin``, ``answer_margin``,
            ``detection_margin``).
    """

    def __init__(
        self, export: Path, tool_name: str, top_k: int | None = None, base_model: str | None = None,
        output_dir: Path = Path("served_outputs"), max_image_pixels: int = RequestLimits.max_image_pixels,
        max_request_pixels: int = RequestLimits.max_request_pixels, image_root: Optional[Path] = None,
        margins: Optional[dict[str, float]] = None,
    ) -> None:
        super().__init__(api_path=f"/v1/{tool_name}")
        self.export, self.top_k, self.base_model, self.output_dir = export, top_k, base_model, output_dir
        self.max_image_pixels, self.max_request_pixels = max_image_pixels, max_request_pixels
        self.image_root = Path(os.path.realpath(image_root)) if image_root is not None else None
        self.margins = dict(margins or {})
        self.setup_report: Optional[Path] = None  # where a worker that fails to load writes why

    def check(self) -> None:
        """Before the workers start: what can be checked without loading the model."""
        from clova_train.tools.prompt_server import PromptToolServer

        PromptToolServer.check_export(self.export, self.base_model)

    def setup(self, device: str) -> None:
        from PIL import Image

        from clova_train.tools.prompt_server import PromptToolServer

        Image.MAX_IMAGE_PIXELS = self.max_image_pixels  # the image reader refuses anything above it from the header
        with reported_setup(self.setup_report):
            self.server = PromptToolServer.from_export(self.export, self.top_k, device, self.base_model,
                                                       **self.margins)

    def decode_request(self, request):  # noqa: ANN001, ANN201 (unannotated: LitServe then hands over the parsed JSON)
        if not isinstance(request, dict):
            raise HTTPException(400, "the request body must be a JSON object")
        if "output" in request:
            request = {**request, "output": str(served_output_path(self.output_dir, request["output"]))}
        return request

    def predict(self, request: dict[str, Any]) -> dict[str, Any]:
        from clova_train.serving.data_urls import (SENT_FORMATS, RequestTooLarge, check_request_pixels,
                                                   confined_server_paths, materialised_images)
        from clova_train.tools.images import ImageReadError

        origins: dict[str, str] = {}
        given_names: dict[str, str] = {}  # a resolved server path -> the name the client sent
        try:
            request = confined_server_paths(request, self.image_root, given_names)  # before anything reads a file
            with materialised_images(request) as (request, origins):
                check_request_pixels(request, origins, self.max_request_pixels)
                return self.server.serve(request)
        except RequestTooLarge as err:
            raise HTTPException(413, str(err)) from None
        except ImageReadError as err:
            if err.path in origins:
                raise HTTPException(400, f"{origins[err.path]} is not a readable image of at most "
                                         f"{self.max_image_pixels:,} pixels in one of the formats accepted "
                                         f"({', '.join(SENT_FORMATS)})") from None
            raise HTTPException(400, unreadable_image_message(given_names.get(err.path, err.path),
                                                              self.max_image_pixels)) from None
        except ClovaTrainError as err:
            raise HTTPException(400, str(err)) from None

    def encode_response(self, output):  # noqa: ANN001, ANN201 (unannotated: a plain JSON response)
        return output


class DepthAPI(PromptToolAPI):
    """``POST /v1/depth``: a frozen depth-estimation model (:class:`~clova_train.tools.depth.DepthEstimator`), its
    requests read and refused as a prompt tool's are (``data:`` URLs, server paths, pixel limits, 400 naming the field).

    Args:
        model_dir: the model's directory (written by transformers' ``save_pretrained``).
        max_image_pixels: largest image decoded (width x height, read from the header before any pixel).
        max_request_pixels: most pixels of a request's image (read from its header).
        image_root: the folder whose image files clients may name (``None``: none).
    """

    def __init__(self, model_dir: Path, max_image_pixels: int = RequestLimits.max_image_pixels,
                 max_request_pixels: int = RequestLimits.max_request_pixels, image_root: Optional[Path] = None) -> None:
        super().__init__(model_dir, "depth", max_image_pixels=max_image_pixels, max_request_pixels=max_request_pixels,
                         image_root=image_root)

    def check(self) -> None:
        from clova_train.tools.depth import check_depth_model_dir

        check_depth_model_dir(self.export)

    def setup(self, device: str) -> None:
        from PIL import Image

        from clova_train.tools.depth import DepthEstimator

        Image.MAX_IMAGE_PIXELS = self.max_image_pixels
        with reported_setup(self.setup_report):
            self.server = DepthEstimator.from_pretrained(self.export, device)


COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")
DISCONNECT_POLL_SECONDS = 0.1  # how often a non-streamed chat request checks that its client is still there


def _step_of(response: Any, status: Any) -> dict[str, Any]:
    """One streamed step of a choice (the API's chat message with its cumulative token counts), or the error."""
    if status == LitAPIStatus.ERROR:
        raise response if isinstance(response, HTTPException) else HTTPException(500, "generation failed")
    return json.loads(response)


def _usage(steps: list[dict[str, Any]]) -> dict[str, int]:
    """The token counts of the choices' last steps (each step's counts are cumulative), added up."""
    return {k: sum(int(step.get(k) or 0) for step in steps) for k in COUNTS}


class ChatRequestBody(ChatCompletionRequest):
    """A chat request as OpenAI's API takes it: a function without a description, any ``tool_choice`` (checked by
    the spec, so that the error names it)."""

    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Any] = "auto"
    seed: Optional[int] = None
    logprobs: Optional[bool] = None  # declared so that asking for them is refused, not silently ignored
    top_logprobs: Optional[int] = None
    _abandon_token: Optional[str] = PrivateAttr(default=None)  # set by the server, never by the client
    _served: Optional[Any] = PrivateAttr(default=None)  # the request as checked once by the server


class ToolChatSpec(OpenAISpec):
    """LitServe's OpenAI chat spec, with the messages, tools and model name checked before a request joins a batch,
    ``GET /v1/models``, token-by-token server-sent events for ``stream: true``, tool calls, and each choice's
    ``finish_reason`` as generation ended (``stop``, ``length`` or ``tool_calls``).

    Args:
        served_name: the model name clients address (``model``), listed by ``/v1/models``.
    """

    def __init__(self, served_name: str) -> None:
        super().__init__()
        self.served_name = served_name
        self.created = int(time.time())
        self.abandoned: Optional[AbandonedRequests] = None  # set by serve_http: where gone clients are marked
        self.budget: Optional[ContextBudget] = None  # set by the API's check: the model's context, for a 400
        self.default_temperature = 0.0  # set by the API's check: the export's (default_temperature)

    def pre_setup(self, lit_api: ls.LitAPI) -> None:
        super().pre_setup(lit_api)
        self.add_endpoint("/v1/models", self.list_models, ["GET"])

    async def list_models(self) -> dict:
        return {"object": "list", "data": [{"id": self.served_name, "object": "model", "created": self.created,
                                            "owned_by": "clova-train"}]}

    async def chat_completion(self, request: ChatRequestBody, background_tasks: BackgroundTasks,  # noqa: ANN201
                              http_request: Request):
        if request.model and request.model != self.served_name:
            raise HTTPException(404, f"The model {request.model!r} does not exist: this server serves "
                                     f"{self.served_name!r} (GET /v1/models)")
        if request.n != 1:
            raise HTTPException(400, "'n' must be 1")
        if request.temperature is not None and not 0 <= request.temperature <= 2:
            raise HTTPException(400, f"'temperature' must be between 0 and 2, got {request.temperature}")
        for name in ("max_tokens", "max_completion_tokens"):
            value = getattr(request, name)
            if value is not None and value < 1:
                raise HTTPException(400, f"'{name}' must be at least 1, got {value}")
        if request.tool_choice not in (None, "auto", "none"):
            raise HTTPException(400, "'tool_choice' must be 'auto' or 'none' (the model chooses its tool itself)")
        try:
            request._served = served_chat(request, self.default_temperature)
            if self.budget is not None:  # before any generation: a prompt past the context is the client's error
                # rendered in the template's limited child: off the event loop, so a slow template holds one request
                await asyncio.to_thread(self.budget.check, request._served.request)
        except DataError as err:
            raise HTTPException(400, str(err)) from err
        except ExportError as err:  # the export's template failed (timeout, output cap): the server's fault
            raise HTTPException(500, str(err)) from err
        if self.abandoned is not None:
            request._abandon_token = token = AbandonedRequests.new_token()
        if self.abandoned is None or request.stream:  # a client leaving a stream ends it: streaming_completion marks it
            return await super().chat_completion(request, background_tasks)
        answer = asyncio.ensure_future(super().chat_completion(request, background_tasks))
        while not answer.done():
            await asyncio.wait([answer], timeout=DISCONNECT_POLL_SECONDS)
            if not answer.done() and await http_request.is_disconnected():
                self.abandoned.mark(token)
                answer.cancel()
                raise HTTPException(499, "the client closed the connection")  # nobody reads it
        return answer.result()

    def _header(self, request: ChatCompletionRequest, kind: str) -> dict[str, Any]:
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": kind, "created": int(time.time()),
                "model": request.model or self.served_name}

    async def non_streaming_completion(self, request: ChatCompletionRequest, generator_list: list):  # noqa: ANN201
        choices, lasts = [], []
        for index, steps in enumerate(generator_list):
            parts, last, calls = [], {}, []
            async for response, status in steps:
                last = _step_of(response, status)
                parts.append(last.get("content") or "")
                calls += last.get("tool_calls") or []
            # null only beside tool calls, as OpenAI answers; a reply that stopped at once is the empty text
            message: dict[str, Any] = {"role": "assistant", "content": "".join(parts) or (None if calls else "")}
            if calls:
                message["tool_calls"] = calls
            choices.append({"index": index, "message": message, "finish_reason": last.get("finish_reason") or "stop"})
            lasts.append(last)
        return {**self._header(request, "chat.completion"), "choices": choices, "usage": _usage(lasts)}

    async def streaming_completion(self, request: ChatCompletionRequest, pipe_responses: list):  # noqa: ANN201
        header = self._header(request, "chat.completion.chunk")  # one id for every chunk of the completion
        lasts: list[dict[str, Any]] = [{} for _ in pipe_responses]
        complete = False
        try:
            opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                       for i in range(len(pipe_responses))]
            yield f"data: {json.dumps({**header, 'choices': opening})}\n\n"  # the role first, as OpenAI sends it
            async for steps in azip(*pipe_responses):
                choices = []
                for index, (response, status) in enumerate(steps):
                    step = lasts[index] = _step_of(response, status)
                    delta = {key: step[key] for key in ("content", "tool_calls") if step.get(key)}
                    if delta:
                        choices.append({"index": index, "delta": delta, "finish_reason": None})
                if choices:
                    yield f"data: {json.dumps({**header, 'choices': choices})}\n\n"
            finished = [{"index": i, "delta": {}, "finish_reason": last.get("finish_reason") or "stop"}
                        for i, last in enumerate(lasts)]
            yield f"data: {json.dumps({**header, 'choices': finished, 'usage': _usage(lasts)})}\n\n"
            yield "data: [DONE]\n\n"
            complete = True
        except HTTPException as err:
            yield f"data: {json.dumps(error_body(err.status_code, str(err.detail)))}\n\n"
        except Exception:  # noqa: BLE001 (the client gets OpenAI's error event; the log gets the traceback)
            import logging

            logging.getLogger(__name__).exception("streamed chat completion failed")
            yield f"data: {json.dumps(error_body(500, 'internal server error'))}\n\n"
        finally:  # ended before its last chunk went out: the client went away (Starlette cancelled the stream)
            token = getattr(request, "_abandon_token", None)
            if not complete and token and self.abandoned is not None:
                self.abandoned.mark(token)


def requested_temperature(request: ChatCompletionRequest, default: float = 0.0) -> float:
    """The temperature the client asked for; the export's ``default`` when it named none (the request model's own
    default, 0.7, is not what the client said)."""
    if "temperature" not in request.model_fields_set or request.temperature is None:
        return default
    return float(request.temperature) if request.temperature >= 1e-5 else 0.0  # a vanishing one: greedy


@dataclass
class ServedChat:
    """A decoded chat request: what the model is asked, and the request's tools when its reply is read as a call."""

    request: ChatRequest
    tools: Optional[list[ToolSpec]] = None
    stream: bool = False


def refuse_unsupported(request: ChatCompletionRequest) -> None:
    """A :class:`DataError` naming the first parameter this server cannot honour (rather than accepting and
    ignoring it): presence and frequency penalties other than 0, log probabilities, a JSON response format."""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(request, name) not in (None, 0, 0.0):
            raise DataError(f"'{name}' is not supported by this server (only 0)")
    if getattr(request, "logprobs", None) or getattr(request, "top_logprobs", None):
        raise DataError("'logprobs' and 'top_logprobs' are not supported by this server")
    kind = getattr(request.response_format, "type", None)
    if kind not in (None, "text"):
        raise DataError(f"'response_format' of type {kind!r} is not supported: the model's output is not constrained "
                        "to JSON (only 'text')")


def message_text(content: Any, index: int) -> Any:
    """A message's content as text: a string as it is, a list of text parts joined by newlines (as vLLM joins them);
    any other part is a :class:`DataError` naming the message."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        kind = getattr(part, "type", None) or (part.get("type") if isinstance(part, dict) else None)
        text = getattr(part, "text", None) if not isinstance(part, dict) else part.get("text")
        if kind != "text" or not isinstance(text, str):
            raise DataError(f"messages[{index}].content: only text parts are supported, got a {kind!r} part")
        texts.append(text)
    return "\n".join(texts)


def served_chat(request: ChatCompletionRequest, default_temperature: float = 0.0) -> ServedChat:
    """The request as the model is asked it, checked once (a :class:`DataError` naming what is wrong): with tools,
    the chat rendered into GPT4Tools' instruction, else its messages."""
    refuse_unsupported(request)
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    top_p = 1.0 if request.top_p is None else float(request.top_p)
    if not 0 < top_p <= 1:
        raise DataError(f"'top_p' must be in (0, 1], got {top_p}")
    seed = request.seed if request.seed is not None else secrets.randbelow(2**31)  # no seed: fresh randomness
    options = {"max_tokens": request.max_completion_tokens or request.max_tokens, "stop": stop,
               "temperature": requested_temperature(request, default_temperature), "seed": seed, "top_p": top_p}
    messages = [{**m.model_dump(), "content": message_text(m.content, index)} for index, m in enumerate(request.messages)]
    if request.tools and request.tool_choice != "none":
        tools = specs_from_openai(request.tools)
        instruction = instruction_from_chat(messages, tools)
        return ServedChat(ChatRequest(messages=[{"role": "user", "content": instruction}], **options), tools,
                          bool(request.stream))
    return ServedChat(ChatRequest(messages=[{"role": m["role"], "content": m["content"]} for m in messages],
                                  **options), stream=bool(request.stream))


class ToolChatAPI(ls.LitAPI):
    """``POST /v1/chat/completions`` for a LoRA tool-LLM export.

    Args:
        export: export directory (``merged/`` is served when present, else base + ``adapter/``).
        base_model: base model directory overriding the export's.
        max_batch_size: requests generated together.
        batch_timeout: seconds to wait for a batch to fill.
        served_name: the model name clients address (default: the export path as given, as vLLM names a model by
            its path).
    """

    def __init__(self, export: Path, base_model: Optional[str] = None, max_batch_size: int = 4,
                 batch_timeout: float = 0.02, served_name: Optional[str] = None) -> None:
        super().__init__(max_batch_size=max_batch_size, batch_timeout=batch_timeout, stream=True,
                         spec=ToolChatSpec(served_name or str(export)))
        self.export, self.base_model = export, base_model
        self.setup_report: Optional[Path] = None  # where a worker that fails to load writes why
        self.abandoned: Optional[AbandonedRequests] = None  # where the HTTP side marks requests whose client left

    def check(self) -> None:
        """Before the workers start: what can be checked without loading the model."""
        self.spec.budget = ContextBudget.from_export(self.export, self.base_model)  # checks the export too
        self.spec.default_temperature = default_temperature(self.export)

    def setup(self, device: str) -> None:
        from clova_train.tooluse.served_llm import ServedToolLLM

        with reported_setup(self.setup_report):
            self.llm = ServedToolLLM.from_export(self.export, self.base_model, device)

    def decode_request(self, request: ChatRequestBody) -> ServedChat:
        # checked by the server's spec; built here otherwise
        served = request._served or served_chat(request, default_temperature(self.export))
        token = getattr(request, "_abandon_token", None)
        if token and self.abandoned is not None:
            served.request.abandoned = functools.partial(self.abandoned.is_abandoned, token)
        return served

    def batch(self, inputs: list[ServedChat]) -> list[ServedChat]:
        return list(inputs)

    def unbatch(self, output: Any) -> Any:
        return output

    def predict(self, chats: Union[ServedChat, list[ServedChat]]):  # noqa: ANN201 (a generator, as the spec wants)
        """After each generated token, one chat message per request: the text added since the last one (held back
        while it ends in half a character or in what may begin a stop string, which is never sent, and for a request
        with tools until its step is complete, then sent as the call or the reply), the finish reason once it ended,
        and the token counts so far."""
        batched = isinstance(chats, list)
        chats = chats if batched else [chats]
        sent = [""] * len(chats)
        answered: dict[int, dict[str, Any]] = {}  # requests with tools whose call or reply went out
        # a batch nobody streams is handed over once, when generated (see ServedToolLLM.stream_batch)
        every_step = any(chat.stream for chat in chats)
        for replies in self.llm.stream_batch([chat.request for chat in chats], every_step=every_step):
            messages = []
            for k, (chat, reply) in enumerate(zip(chats, replies)):
                counts = {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
                          "total_tokens": reply.prompt_tokens + reply.completion_tokens}
                if chat.tools is not None:
                    if k in answered:  # sent once; later steps only repeat how it finished
                        messages.append({"role": "assistant", "content": "", **counts,
                                         "finish_reason": answered[k]["finish_reason"]})
                        continue
                    step = self._tool_reply(chat, reply)
                    if step["finish_reason"] is not None:
                        answered[k] = step
                    messages.append({"role": "assistant", **counts, **step})
                    continue
                ready = reply.text
                if not reply.finish_reason:  # half a character, or what may be the start of a stop string, waits
                    ready = ready.rstrip("\ufffd")
                    ready = ready[: len(ready) - pending_stop(ready, self.llm.stops(chat.request))]
                delta = ready[len(sent[k]):] if ready.startswith(sent[k]) else ""
                sent[k] += delta
                messages.append({"role": "assistant", "content": delta, "finish_reason": reply.finish_reason, **counts})
            yield messages if batched else messages[0]

    @staticmethod
    def _tool_reply(chat: ServedChat, reply: Any) -> dict[str, Any]:
        if reply.finish_reason is None:
            return {"content": "", "finish_reason": None}
        read = reply_from_step(reply.text, chat.tools or [])
        if "tool_call" not in read:
            return {"content": read["content"], "finish_reason": reply.finish_reason}
        if reply.finish_reason != "stop":  # a step max_tokens cut is no call: its text as written
            return {"content": reply.text, "finish_reason": reply.finish_reason}
        call = {"index": 0, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": read["tool_call"]}
        return {"content": "", "tool_calls": [call], "finish_reason": "tool_calls"}

    def encode_response(self, outputs):  # noqa: ANN001, ANN201 (a generator of chat messages, one per token)
        # Batched: each step is a list with one message per request; LitServe hands message i to request i.
        yield from outputs


def build_apis(
    exports: list[str], top_k: int | None, base_model: str | None, max_batch_size: int, batch_timeout: float,
    output_dir: Path = Path("served_outputs"), max_image_pixels: int = RequestLimits.max_image_pixels,
    served_model_name: str | None = None, max_request_pixels: int = RequestLimits.max_request_pixels,
    image_root: Optional[Path] = None, margins: Optional[dict[str, Optional[float]]] = None,
) -> list[ls.LitAPI]:
    """One LitAPI per export; a clear error for a missing export or two exports on one endpoint, or for a served
    margin (``margins``: ``classify_margin`` / ``answer_margin`` / ``detection_margin`` overrides) that no served
    export takes."""
    from clova_train.tools.prompt_server import margins_taken, read_tool_description

    wanted = {name: value for name, value in (margins or {}).items() if value is not None}
    used: set[str] = set()
    apis: dict[str, ls.LitAPI] = {}
    for name in exports:
        directory = Path(name)
        kind = export_kind(directory)
        if kind == "lora":
            api: ls.LitAPI = ToolChatAPI(directory, base_model, max_batch_size, batch_timeout, served_model_name)
            path = "/v1/chat/completions"
        elif kind == "depth":
            api = DepthAPI(directory, max_image_pixels, max_request_pixels, image_root)
            path = api.api_path
        else:
            tool = str(read_tool_description(directory).get("tool", "tool"))
            taken = margins_taken(directory, wanted)
            used |= set(taken)
            api = PromptToolAPI(directory, tool, top_k, base_model, output_dir, max_image_pixels, max_request_pixels,
                                image_root, taken)
            path = api.api_path
        if path in apis:
            raise ExportError(f"two exports would both serve {path} ({name} and an earlier one): start one server per export")
        apis[path] = api
    unused = sorted(set(wanted) - used)
    if unused:
        raise ExportError(f"--{unused[0].replace('_', '-')}: no served export's tool takes {unused[0]} (CLIP exports "
                          "take classify_margin, BLIP VQA exports answer_margin, OWL-ViT LOC exports detection_margin)")
    return list(apis.values())


class WorkersFailed(RuntimeError):
    """A worker of the server could not load its export."""


class ExportServer(ls.LitServer):
    """LitServer that opens its port only once every worker has loaded its export (LitServer's own check waits for
    the first ready worker, so a server of two exports would answer with one of them broken), and stops its
    workers when one fails."""

    def verify_worker_status(self) -> None:
        while True:
            states = list(self.workers_setup_status.values())
            if WorkerSetupStatus.ERROR in states:
                for worker in self.inference_workers:
                    worker.terminate()
                for worker in self.inference_workers:
                    worker.join(timeout=10)
                raise WorkersFailed("a worker could not load its export")
            if states and all(state == WorkerSetupStatus.READY for state in states):
                print(f"serving {', '.join(api.api_path for api in self.litapi_connector)} (all loaded)", flush=True)
                return
            time.sleep(0.05)


def serve_http(
    exports: list[str], host: str = "127.0.0.1", port: int = 8000, device: str = "cpu", top_k: int | None = None,
    base_model: str | None = None, max_batch_size: int = 4, batch_timeout: float = 0.02, timeout: float = 60.0,
    output_dir: str = "served_outputs", api_key: str | None = None, limits: RequestLimits = RequestLimits(),
    served_model_name: str | None = None, image_root: str | None = None,
    connections: ConnectionLimits = ConnectionLimits(), margins: Optional[dict[str, Optional[float]]] = None,
) -> None:
    """Run the server until interrupted (each export is checked here, then loaded once, by its worker, before the port
    opens; a worker that cannot load its export stops the server with that export's one-line error).

    ``api_key``: the bearer token every ``/v1/...`` request must carry (``None``: none required); ``limits``: what one
    request may hold (see :class:`~clova_train.serving.guard.RequestLimits`); ``served_model_name``: the chat model's
    name (default: the export path as given); ``image_root``: the folder whose image files clients may name (``None``:
    clients send images, no server file is read for them); ``connections``: how many connections are held and how
    long a request may take to arrive (see :mod:`clova_train.serving.connections`); ``margins``: served margins
    (``classify_margin``, ``answer_margin``, ``detection_margin``) overriding the ones the exports carry, for the
    exports that take them."""
    if image_root is not None and not Path(image_root).is_dir():
        raise ExportError(f"--image-root {image_root} is not a folder")
    apis = build_apis(exports, top_k, base_model, max_batch_size, batch_timeout, Path(output_dir),
                      limits.max_image_pixels, served_model_name, limits.max_request_pixels,
                      Path(image_root) if image_root is not None else None, margins)
    for api in apis:  # what fails without a model fails here, before any worker starts
        api.check()
    accelerator = "cuda" if device.startswith("cuda") else "cpu"
    os.environ.setdefault("LITSERVE_LOG_LEVEL", "WARNING")
    with tempfile.TemporaryDirectory(prefix="clova-train-serve-") as reports:
        for number, api in enumerate(apis):
            api.setup_report = Path(reports) / f"{number}.txt"
            if isinstance(api, ToolChatAPI):
                api.abandoned = api.spec.abandoned = AbandonedRequests(Path(reports) / "abandoned")
        server = ExportServer(apis, accelerator=accelerator, devices=1, timeout=timeout,
                              middlewares=[(RequestGuard, {"api_key": api_key, "limits": limits})])
        install_error_handlers(server.app)
        print(f"loading {', '.join(exports)} for http://{host}:{port} ...", flush=True)
        with stop_on_signals() as received:
            try:
                protocol = bounded_protocol(connections, raise_open_file_limit())
                server.run(host=host, port=port, generate_client_file=False, num_api_servers=1, log_level="warning",
                           http=protocol, timeout_keep_alive=5)
            except WorkersFailed:
                failures = [report.read_text(encoding="utf-8") for report in sorted(Path(reports).glob("*.txt"))]
                raise ExportError("; ".join(failures) or "a server worker could not load its export") from None
            except KeyboardInterrupt:  # a stop signal before LitServe's own graceful path began (still loading)
                pass
            finally:
                stop_children()
        if received:
            print(f"stopped ({signal.Signals(received[0]).name})", flush=True)
