"""What every HTTP request meets before it reaches a model: the API key, size limits and a JSON check.

:class:`RequestGuard` is a plain ASGI middleware in front of the LitServe (FastAPI) app. For each request it

* requires ``Authorization: Bearer <key>`` on ``/v1/...`` when the server has an API key (as vLLM does; ``/health``
  stays open for load balancers), compared in constant time;
* reads the body up to ``max_body_bytes``: a larger ``Content-Length`` is refused before anything is read, a body
  sent in chunks is refused by the chunk that passes the limit, and a ``gzip``/``deflate`` body is decompressed as it
  arrives with the limit counted on the decompressed bytes (a small gzip bomb is refused by its first chunks, not
  inflated); other encodings are refused before the body is read;
* holds at most ``max_inflight_body_bytes`` of request bodies at once over all requests of the server process
  (counted as they are read, raw and decompressed, and held until the request's response is sent, since the app
  makes copies of its own): a body that would pass it is answered 503 with ``Retry-After`` at once, so 24 clients
  sending 15 MB bodies together cannot take gigabytes. The body of a request refused before it was read (no key,
  server busy) is read and dropped when its declared length is within ``max_body_bytes``, so that the client gets
  the answer and the connection stays usable; else the answer closes the connection (what follows on it cannot be
  told from the unread body);
* parses the body once with the package's safe JSON reader (depth limit, duplicate keys refused) whatever the
  ``Content-Type`` (curl's form default included), refuses any list longer than ``max_list_items``, and hands the
  app the canonical JSON it parsed;
* turns a ``multipart/form-data`` body (``curl -F``) into that same JSON object: each uploaded file becomes a
  ``data:`` URL (:mod:`clova_train.serving.data_urls`), a text field its value (JSON when it reads as a list, an
  object or a number), and a repeated field (or ``images``) a list;

and answers every refusal, like every error of the app (see :func:`install_error_handlers`), with OpenAI's error
shape ``{"error": {"message", "type", "param", "code"}}``: 401, 400, 413, 415 or 503, never a 500 with a traceback.
Each request meets the guard, pipelined and kept-alive ones included: a connection that sent one authorised request
gains nothing for the next. How many connections the server holds and how long a client may take to send a request
are :mod:`clova_train.serving.connections`' part.
"""

from __future__ import annotations

import hmac
import json
import re
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from clova_train.core.errors import DataError
from clova_train.core.safe_files import JSONSyntaxError, ReadLimits, parse_json

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
               415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
               503: "server_busy_error"}
OPEN_PATHS = ("/health",)  # answered without an API key (as vLLM leaves /health open)


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on one request, checked before it reaches a model.

    Args:
        max_body_bytes: largest request body, counted after decompression.
        max_depth: deepest JSON nesting of a body.
        max_list_items: longest list anywhere in a body (images of one request, labels, messages, ...).
        max_image_pixels: largest image (width x height) a prompt tool decodes; larger ones are refused from their
            header, before their pixels are read.
        max_request_pixels: most pixels of all of one request's images together (read from their headers; a body of
            small files can describe huge canvases).
        max_inflight_body_bytes: most bytes of request bodies the server holds at once, over all requests (503
            beyond, with ``Retry-After``).
    """

    max_body_bytes: int = 16 << 20
    max_depth: int = 32
    max_list_items: int = 256
    max_image_pixels: int = 40_000_000
    max_request_pixels: int = 100_000_000
    max_inflight_body_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_depth", "max_list_items", "max_image_pixels", "max_request_pixels",
                     "max_inflight_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape (what the official SDKs read the message from)."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error" if status >= 500 else
                                                               "invalid_request_error"),
                      "param": param, "code": status}}


class RequestRefused(Exception):
    """A request refused by the guard: its status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class BodyBudget:
    """Bytes of request bodies held at once by one server process (its requests share one event loop)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held = limit, 0

    def take(self, size: int) -> bool:
        """Hold ``size`` more bytes; ``False`` (nothing held) when that would pass the limit."""
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def give_back(self, size: int) -> None:
        self.held = max(0, self.held - size)


class BodyReader:
    """One request's body read piece by piece: the raw and (gzip/deflate) decompressed size limit checked on each
    piece, every byte held counted against the server's :class:`BodyBudget`."""

    def __init__(self, encoding: str, limit: int, budget: BodyBudget) -> None:
        self.encoding, self.limit, self.budget = encoding, limit, budget
        self.held = 0  # bytes taken from the budget, given back when the request ends
        self.prepaid = 0  # of those, bytes taken ahead (a declared Content-Length) not yet used
        self.size = 0  # bytes of the (decompressed) body so far
        self.pieces: list[bytes] = []
        self.inflater = None
        if encoding in ("gzip", "x-gzip", "deflate"):
            wbits = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}[encoding]
            self.inflater = zlib.decompressobj(wbits)

    def hold(self, size: int) -> None:
        """Count ``size`` more bytes against the server's budget (503 when it is spent)."""
        used = min(size, self.prepaid)
        self.prepaid -= used
        size -= used
        if size and not self.budget.take(size):
            raise RequestRefused(503, f"the server holds {self.budget.limit:,} bytes of request bodies at most and is "
                                      "busy with others: retry shortly")
        self.held += size

    def feed(self, chunk: bytes) -> None:
        if not chunk:
            return
        if self.inflater is None:
            self._keep(chunk)
            return
        self.hold(len(chunk))  # the compressed piece, while it is inflated
        try:
            data = self.inflater.decompress(chunk, self.limit - self.size + 1)
            while True:
                self._keep(data)
                tail = self.inflater.unconsumed_tail
                if not tail:
                    break
                data = self.inflater.decompress(tail, self.limit - self.size + 1)
        except zlib.error as err:
            raise RequestRefused(400, f"the request body is not valid {self.encoding} data: {err}") from None

    def body(self) -> bytes:
        if self.inflater is not None and not self.inflater.eof:
            raise RequestRefused(400, f"the request body is truncated {self.encoding} data")
        body, self.pieces, self.inflater = b"".join(self.pieces), [], None  # one copy kept, by the caller
        return body

    def _keep(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.limit:
            raise RequestRefused(413, f"the request body is more than the {self.limit:,} bytes accepted"
                                      f"{' once decompressed' if self.inflater is not None else ''}")
        self.hold(len(data))
        self.pieces.append(data)


def longest_list(value: Any) -> tuple[int, str]:
    """The length and JSON path of the longest list in ``value`` (``(0, "")`` when there is none)."""
    best, where = 0, ""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in item.items())
        elif isinstance(item, list):
            if len(item) > best:
                best, where = len(item), path or "the body"
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(item))
    return best, where


class RequestGuard:
    """ASGI middleware: API key, body limits and one safe JSON parse for every request (see module docstring).

    Args:
        app: the ASGI app behind it.
        api_key: the bearer token ``/v1/...`` requires (``None``: no key).
        limits: the request limits.
    """

    def __init__(self, app: ASGIApp, api_key: str | None = None, limits: RequestLimits = RequestLimits()) -> None:
        self.app, self.api_key, self.limits = app, api_key or None, limits
        self.json_limits = ReadLimits(max_bytes=limits.max_body_bytes, max_depth=limits.max_depth)
        self.budget = BodyBudget(limits.max_inflight_body_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        reader: BodyReader | None = None
        body_read = scope["method"] not in ("POST", "PUT", "PATCH")
        try:
            try:
                self._authorise(scope)
                if not body_read:
                    reader = self._reader(scope)
                    body = await self._read_body(scope, receive, reader)
                    body_read = True
                    value = await self._parse(scope, body)
                    del body
                    scope, receive = self._as_json(scope, value, receive)
                    del value
            except RequestRefused as refused:
                headers = {"www-authenticate": "Bearer"} if refused.status == 401 else {}
                if refused.status == 503:
                    headers["retry-after"] = "1"
                if not body_read and not (refused.status in (401, 503) and await self._discard_body(scope, receive)):
                    headers["connection"] = "close"  # its body is unread: nothing after it on the connection is usable
                await send_error(send, refused.status, str(refused), headers)
                return
            await self.app(scope, receive, send)
        finally:
            if reader is not None:
                self.budget.give_back(reader.held)

    async def _discard_body(self, scope: Scope, receive: Receive) -> bool:
        """Read and drop the body of a request refused before it was read (no key, server busy), so that the client
        reads the answer and the connection stays usable; ``False`` (stopped) beyond ``max_body_bytes`` or without a
        declared length within it. Nothing is kept; the connection's body deadline bounds the time."""
        declared = _header(scope, b"content-length")
        if declared is None or not declared.strip().isdigit() or int(declared) > self.limits.max_body_bytes:
            return False
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return False
            if not message.get("more_body", False):
                return True

    def _authorise(self, scope: Scope) -> None:
        path = scope.get("path", "")
        if self.api_key is None or not path.startswith("/v1") or path in OPEN_PATHS:
            return
        given = _header(scope, b"authorization")
        expected = f"Bearer {self.api_key}".encode()
        if given is None or not hmac.compare_digest(given, expected):
            raise RequestRefused(401, "a valid API key is required: send 'Authorization: Bearer <key>'")

    def _reader(self, scope: Scope) -> BodyReader:
        """A reader for the request's body, once its headers are known to be acceptable (before any of it is read)."""
        limit = self.limits.max_body_bytes
        encoding = (_header(scope, b"content-encoding") or b"identity").decode("latin-1").strip().lower()
        if encoding not in ("", "identity", "gzip", "x-gzip", "deflate"):
            raise RequestRefused(415, f"Content-Encoding {encoding!r} is not accepted (send identity, gzip or deflate)")
        declared = _header(scope, b"content-length")
        reader = BodyReader(encoding, limit, self.budget)
        if declared is not None:
            if not declared.strip().isdigit():
                raise RequestRefused(400, "the Content-Length header is not a number")
            if int(declared) > limit:
                raise RequestRefused(413, f"the request body is {int(declared):,} bytes, more than the {limit:,} accepted")
            reader.hold(int(declared))  # refused at once when the server holds too many bodies already
            reader.prepaid = int(declared)
        return reader

    async def _read_body(self, scope: Scope, receive: Receive, reader: BodyReader) -> bytes:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise RequestRefused(400, "the client went away before sending its whole body")
            reader.feed(message.get("body", b""))
            if not message.get("more_body", False):
                return reader.body()

    async def _parse(self, scope: Scope, body: bytes) -> Any:
        """The body as a JSON value: parsed safely, or (multipart) converted field by field."""
        content_type = (_header(scope, b"content-type") or b"").decode("latin-1").lower()
        if content_type.startswith("multipart/"):
            return await form_as_json(scope, body, self.limits, self.json_limits)
        if not body.strip():
            raise RequestRefused(400, "the request body is empty: send a JSON object")
        try:
            return parse_json(body, "the request body", self.json_limits, finite_only=True)
        except DataError as err:
            raise RequestRefused(400, str(err)) from None

    def _as_json(self, scope: Scope, value: Any, receive: Receive) -> tuple[Scope, Receive]:
        """The scope and a ``receive`` for the app: the canonical JSON as the whole body, then the client's own
        ``receive``, which reports a real disconnect only (a fake one after the body cut every streamed response)."""
        items, where = longest_list(value)
        if items > self.limits.max_list_items:
            raise RequestRefused(413, f"{where} has {items:,} items, more than the {self.limits.max_list_items:,} "
                                      "this server accepts in one list")
        # A lone surrogate (a JSON escape such as \ud800) would fail every tokenizer: it becomes "?" here.
        canonical = json.dumps(value, ensure_ascii=False).encode("utf-8", "replace")
        headers = [(k, v) for k, v in scope.get("headers", [])
                   if k.lower() not in (b"content-length", b"content-encoding", b"content-type")]
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(canonical)).encode())]
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": canonical, "more_body": False}

        return {**scope, "headers": headers}, replay


LIST_FIELDS = ("images",)  # a form field that is a list even when sent once
_JSON_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?", re.ASCII)


def _form_value(name: str, text: str, limits: ReadLimits) -> Any:
    """A text form field: JSON when it reads as a list, an object or a number (``labels=["red","blue"]``,
    ``seed=3``), parsed by the same safe reader as a JSON body; else the text itself (``concept=red``)."""
    stripped = text.strip()
    if stripped[:1] in ("[", "{") or _JSON_NUMBER.fullmatch(stripped):
        try:
            return parse_json(stripped.encode("utf-8", "replace"), f"form field {name!r}", limits, finite_only=True)
        except JSONSyntaxError:
            return text  # text that only looks like JSON ("[draft] question", "007"): the text itself
        except DataError as err:  # JSON, but too deep, a key twice, or a number out of range
            raise RequestRefused(400, str(err)) from None
    return text


async def form_as_json(scope: Scope, body: bytes, limits: RequestLimits, json_limits: ReadLimits) -> dict[str, Any]:
    """A ``multipart/form-data`` body as the JSON object a prompt tool takes (see the module docstring)."""
    from starlette.requests import Request

    from clova_train.serving.data_urls import as_data_url

    async def whole_body() -> Message:
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        form = await Request(scope, whole_body).form(max_files=limits.max_list_items, max_fields=limits.max_list_items,
                                                     max_part_size=limits.max_body_bytes)
    except Exception as err:  # starlette/python-multipart raise several kinds for a malformed body
        raise RequestRefused(400, f"the multipart body cannot be parsed: {getattr(err, 'detail', err)}") from None
    fields: dict[str, list[Any]] = {}
    try:
        for name, item in form.multi_items():
            if isinstance(item, str):
                fields.setdefault(name, []).append(_form_value(name, item, json_limits))
            else:
                fields.setdefault(name, []).append(as_data_url(await item.read(), item.content_type))
    finally:
        await form.close()
    if not fields:
        raise RequestRefused(400, "the multipart body has no fields: send the request's fields (files as uploads)")
    return {name: values if (len(values) > 1 or name in LIST_FIELDS) else values[0] for name, values in fields.items()}


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value
    return None


async def send_error(send: Send, status: int, message: str, extra_headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(status, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (extra_headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def install_error_handlers(app: Any) -> None:
    """Make a FastAPI app answer its own errors in OpenAI's shape: ``HTTPException`` keeps its status with its
    detail as the message, a request that fails validation is a 400 naming the field, anything unexpected a 500
    that says no more than that (the traceback goes to the server log, not to the client)."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    async def http_error(request: Any, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return JSONResponse(error_body(exc.status_code, detail), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    async def invalid(request: Any, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for error in exc.errors()[:5]:
            where = ".".join(str(part) for part in error.get("loc", ()) if part != "body")
            problems.append(f"{where or 'the body'}: {error.get('msg', 'invalid')}")
        first = exc.errors()[0].get("loc", ()) if exc.errors() else ()
        param = ".".join(str(p) for p in first if p != "body") or None
        return JSONResponse(error_body(400, "; ".join(problems) or "invalid request", param), status_code=400)

    async def unexpected(request: Any, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(500, "internal server error"), status_code=500)

    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(Exception, unexpected)
