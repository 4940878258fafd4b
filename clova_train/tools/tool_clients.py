"""Clients of the visual tools behind ``ImagePatch``: one request format, answered in-process or over HTTP.

A :class:`ToolClient` answers ``request(role, payload)`` with the JSON the tool's server answers. The roles and
their requests are those of this package's exports (each tool's ``serve_request``) and of the depth tool; images
are file paths or ``data:`` URLs:

============  ===========================================================  =======================================
role          request                                                      reply
============  ===========================================================  =======================================
``LOC``       ``{"image": img, "concept": name}``                          ``{"boxes": [[x0, y0, x1, y1], ...]}``
``CLASSIFY``  ``{"images": [img, ...], "labels": [label, ...]}``           ``{"labels": [label, ...]}``
``VQA``       ``{"image": img, "question": text}``                         ``{"answer": text}``
``DEPTH``     ``{"image": img, "boxes": [[x0, y0, x1, y1], ...]}``         ``{"depths": [value, ...]}``
============  ===========================================================  =======================================

Boxes are pixels of the image sent, y from the top. :class:`LocalToolClient` holds loaded servers (a
:class:`~clova_train.tools.prompt_server.PromptToolServer` per export, the depth estimator) and writes a request's
``data:`` URLs to a private temporary directory for the call, as ``clova-train serve`` does;
:class:`HttpToolClient` posts the same JSON to a running ``clova-train serve`` at ``/v1/<tool name>`` with every
image inlined as a ``data:`` URL (the server may not share this machine's disk). Either turns every failure into one
:class:`~clova_train.core.errors.ToolServiceError` naming the role, where it asked and why.
"""

from __future__ import annotations

import copy
import hashlib
import json
import mimetypes
import threading
import os
import urllib.error
import urllib.parse
import urllib.request
from collections import OrderedDict
from collections.abc import Mapping
from http.client import HTTPException
from pathlib import Path
from typing import Any, Protocol

from clova_train.core.errors import ClovaTrainError, ExportError, ToolServiceError
from clova_train.core.safe_files import ReadLimits, parse_json, read_bytes
from clova_train.tools.data_urls import IMAGE_FIELDS, as_data_url, materialised_images
from clova_train.tools.images import ImageReadError

LOC, CLASSIFY, VQA, DEPTH = "LOC", "CLASSIFY", "VQA", "DEPTH"
ROLES = (LOC, CLASSIFY, VQA, DEPTH)
# The served operation an export must have to take a role (a CLIP export cannot detect)
ROLE_OPERATIONS = {LOC: "detect", CLASSIFY: "classify", VQA: "answer"}
DEPTH_ENDPOINT = "depth"  # ``clova-train serve <depth model dir>`` answers at /v1/depth
DEFAULT_API_KEY_ENV = "CLOVA_TRAIN_API_KEY"  # the variable ``clova-train serve`` reads its own key from
MAX_REPLY_BYTES = 16 << 20
MAX_SENT_IMAGE_BYTES = 32 << 20
_REPLY_LIMITS = ReadLimits(max_bytes=MAX_REPLY_BYTES, max_depth=16)


class ToolServer(Protocol):
    """What answers one role in process: ``serve(request) -> reply`` (a prompt-tool server, the depth estimator)."""

    def serve(self, request: dict[str, Any]) -> dict[str, Any]: ...


class ToolClient(Protocol):
    """Answers tool requests by role (see the module docstring); ``roles`` are the ones it can answer."""

    roles: frozenset[str]

    def request(self, role: str, payload: dict[str, Any]) -> dict[str, Any]: ...

    def close(self) -> None: ...


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"unknown tool role {role!r} (roles: {', '.join(ROLES)})")


def describe_export(role: str, directory: str | os.PathLike[str], local: bool = True) -> dict[str, Any]:
    """The ``tool.json`` of the export taking ``role`` (LOC, CLASSIFY or VQA), read without loading its model, checked
    to serve that role's operation; an :class:`ExportError` says what is wrong. ``local``: also check what loading it
    here needs (its pool file and base model, :meth:`PromptToolServer.check_export`); a client of a server needs only
    the description (the endpoint's name)."""
    from clova_train.tools.base import tool_class
    from clova_train.tools.prompt_server import PromptToolServer, read_tool_description

    directory = Path(directory)
    if local:
        description = PromptToolServer.check_export(directory)
    elif not directory.is_dir():
        raise ExportError(f"export directory not found: {directory}")
    else:
        description = read_tool_description(directory)
    try:
        operations = tool_class(description).served_operations
    except ClovaTrainError as err:
        raise ExportError(f"{directory}: {err}") from None
    if ROLE_OPERATIONS[role] not in operations:
        raise ExportError(f"{directory} is an export of {description.get('tool')!r}, which does not serve "
                          f"{ROLE_OPERATIONS[role]!r}: {role} needs an export of a tool that does")
    return description


def endpoint_name(role: str, directory: str | os.PathLike[str] | None) -> str:
    """The last part of the ``/v1/<name>`` path a server answers ``role`` at: the export's tool name (``tool.json``'s
    ``tool``, as ``clova-train serve`` names its endpoints), ``depth`` for DEPTH."""
    _check_role(role)
    if role == DEPTH:
        return DEPTH_ENDPOINT
    if directory is None:
        raise ValueError(f"{role} needs its export directory to know the endpoint")
    return str(describe_export(role, directory, local=False).get("tool", "tool"))


class LocalToolClient:
    """Tools loaded in this process, one server per role.

    Args:
        servers: the server of each role (``LOC``, ``CLASSIFY``, ``VQA``: prompt-tool servers; ``DEPTH``: the depth
            estimator); a role left out is not served.
        sources: what each server was loaded from, for error messages (default: the server's type).
    """

    def __init__(self, servers: Mapping[str, ToolServer], sources: Mapping[str, str] | None = None) -> None:
        for role in servers:
            _check_role(role)
        self.servers = dict(servers)
        self.sources = {role: (sources or {}).get(role) or type(server).__name__ for role, server in servers.items()}
        self.roles = frozenset(self.servers)

    @classmethod
    def load(cls, loc: str | os.PathLike[str] | None = None, classify: str | os.PathLike[str] | None = None,
             vqa: str | os.PathLike[str] | None = None, depth: str | os.PathLike[str] | None = None,
             device: str = "cpu", top_k: int | None = None) -> LocalToolClient:
        """Load the exports of the roles given (``top_k``: the prompt ensemble's, default each tool's own) and the
        depth model; a bad export raises its :class:`ExportError` here, before any request."""
        from clova_train.tools.prompt_server import PromptToolServer

        servers: dict[str, ToolServer] = {}
        sources: dict[str, str] = {}
        for role, directory in ((LOC, loc), (CLASSIFY, classify), (VQA, vqa)):
            if directory is not None:
                describe_export(role, directory)
                servers[role] = PromptToolServer.from_export(directory, top_k=top_k, device=device)
                sources[role] = f"export {directory}"
        if depth is not None:
            from clova_train.tools.depth import DepthEstimator  # its own module: loaded only when asked for

            servers[DEPTH] = DepthEstimator.from_pretrained(depth, device=device)
            sources[DEPTH] = f"depth model {depth}"
        return cls(servers, sources)

    def request(self, role: str, payload: dict[str, Any]) -> dict[str, Any]:
        """The reply of ``role``'s server to ``payload`` (``data:`` URLs written to temporary files for the call)."""
        _check_role(role)
        server = self.servers.get(role)
        if server is None:
            served = ", ".join(sorted(self.roles)) or "none"
            raise ToolServiceError(f"no {role} tool is loaded (this client serves {served})")
        where = f"{role} tool ({self.sources[role]})"
        origins: dict[str, str] = {}
        try:
            with materialised_images(payload) as (request, origins):
                reply = server.serve(request)
        except ImageReadError as err:
            sent = origins.get(err.path)
            reason = f"{sent} is not a readable image" if sent else str(err)
            raise ToolServiceError(f"{where}: {reason}") from None
        except Exception as err:  # noqa: BLE001 (any failure of a tool is one error naming the tool)
            raise ToolServiceError(f"{where} failed: {type(err).__name__}: {err}") from err
        if not isinstance(reply, dict):
            raise ToolServiceError(f"{where} answered a {type(reply).__name__}, not a JSON object")
        return reply

    def close(self) -> None:
        """Drop the loaded models (a closed client answers no request)."""
        self.servers.clear()
        self.roles = frozenset()


class MemoizedToolClient:
    """A client that answers a request it has answered before from memory, without asking the tool again.

    The tools are frozen and their prompt ensembles deterministic, so one request gets one answer; an agent's programs
    ask the same things of the same images again and again (every training episode of a task re-runs its programs).
    Only requests whose images are all inline ``data:`` URLs are remembered, so the key holds the pixels themselves
    (a file path's content could change); the :data:`max_entries` most recently used answers are kept.

    Args:
        client: the client asked on a miss.
        max_entries: answers kept (least recently used dropped first).
    """

    def __init__(self, client: ToolClient, max_entries: int) -> None:
        self.client, self.max_entries = client, max_entries
        self.answers: OrderedDict[bytes, dict[str, Any]] = OrderedDict()
        self.hits = self.misses = 0
        self._lock = threading.Lock()

    @property
    def roles(self) -> frozenset[str]:
        return self.client.roles

    @staticmethod
    def key(role: str, payload: dict[str, Any]) -> bytes | None:
        """What identifies a request (a digest of the role and the whole payload), or None when an image is a path."""
        for name in IMAGE_FIELDS:
            value = payload.get(name)
            values = value if isinstance(value, list) else [value] if value is not None else []
            if not all(isinstance(item, str) and item.startswith("data:") for item in values):
                return None
        try:
            text = json.dumps([role, payload], sort_keys=True, allow_nan=False)
        except (TypeError, ValueError):
            return None
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()

    def request(self, role: str, payload: dict[str, Any]) -> dict[str, Any]:
        key = self.key(role, payload)
        if key is not None:
            with self._lock:
                answer = self.answers.get(key)
                if answer is not None:
                    self.answers.move_to_end(key)
                    self.hits += 1
                    return copy.deepcopy(answer)
        answer = self.client.request(role, payload)
        if key is not None:
            with self._lock:
                self.misses += 1
                self.answers[key] = copy.deepcopy(answer)
                while len(self.answers) > self.max_entries:
                    self.answers.popitem(last=False)
        return answer

    def close(self) -> None:
        self.answers.clear()
        self.client.close()


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is an error: following it would resend the request, and its API key, wherever it points."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


class HttpToolClient:
    """Tools behind a running ``clova-train serve``: ``POST <server_url>/v1/<endpoint>`` with the role's JSON.

    Args:
        server_url: the server's base URL (``http://host:port``).
        endpoints: the endpoint name of each role served (``/v1/<name>``; see :func:`endpoint_name`).
        api_key: sent as ``Authorization: Bearer <key>`` when given.
        timeout_s: how long one request may wait for the server (connecting, then each read).
        max_reply_bytes: largest reply read (replies are asked for and read uncompressed: a compressed one is refused).
    """

    def __init__(self, server_url: str, endpoints: Mapping[str, str], api_key: str | None = None,
                 timeout_s: float = 30.0, max_reply_bytes: int = MAX_REPLY_BYTES) -> None:
        for role in endpoints:
            _check_role(role)
        parsed = urllib.parse.urlsplit(server_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"tool server URL {server_url!r} is not an http:// or https:// URL")
        self.server_url = server_url.rstrip("/")
        self.endpoints = dict(endpoints)
        self.roles = frozenset(self.endpoints)
        self.timeout_s, self.max_reply_bytes = timeout_s, max_reply_bytes
        self._api_key = api_key or None
        self._opener = urllib.request.build_opener(_NoRedirects)

    @classmethod
    def for_exports(cls, server_url: str, loc: str | os.PathLike[str] | None = None,
                    classify: str | os.PathLike[str] | None = None, vqa: str | os.PathLike[str] | None = None,
                    depth: str | os.PathLike[str] | None = None, api_key_env: str = DEFAULT_API_KEY_ENV,
                    timeout_s: float = 30.0) -> HttpToolClient:
        """A client of a server of these exports (each export's endpoint read from its ``tool.json``; ``depth``: only
        whether it is given matters, the server's own depth model answers), with the API key of the environment
        variable ``api_key_env`` when it is set."""
        given = {LOC: loc, CLASSIFY: classify, VQA: vqa, DEPTH: depth}
        endpoints = {role: endpoint_name(role, directory) for role, directory in given.items() if directory is not None}
        api_key = os.environ.get(api_key_env, "").strip() if api_key_env else ""
        return cls(server_url, endpoints, api_key or None, timeout_s)

    def url(self, role: str) -> str:
        """Where ``role``'s requests go."""
        return f"{self.server_url}/v1/{self.endpoints[role]}"

    def request(self, role: str, payload: dict[str, Any]) -> dict[str, Any]:
        """The server's reply to ``payload`` (image paths inlined as ``data:`` URLs), or a :class:`ToolServiceError`
        naming the role, the URL and the reason (refused, timed out, an error status with the server's message)."""
        _check_role(role)
        if role not in self.endpoints:
            raise ToolServiceError(f"no {role} tool is configured for the server at {self.server_url} (this client "
                                   f"serves {', '.join(sorted(self.roles)) or 'none'})")
        url = self.url(role)
        where = f"{role} tool at {url}"
        try:
            body = json.dumps(_inlined(payload)).encode("utf-8")
        except (ClovaTrainError, TypeError, ValueError) as err:
            raise ToolServiceError(f"{where}: the request cannot be sent: {err}") from None
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                encoding = response.headers.get("Content-Encoding", "").strip().lower()
                if encoding not in ("", "identity"):  # urllib asks for identity and decompresses nothing
                    raise ToolServiceError(f"{where}: the reply's Content-Encoding {encoding[:80]!r} was not asked "
                                           "for (this client reads uncompressed replies only)")
                data = response.read(self.max_reply_bytes + 1)
        except urllib.error.HTTPError as err:
            raise ToolServiceError(f"{where}: HTTP {err.code}: {_error_message(err)}") from None
        except urllib.error.URLError as err:
            raise ToolServiceError(f"{where}: {self._reason(err.reason)}") from None
        except (OSError, HTTPException) as err:  # a timeout or a dropped connection while reading
            raise ToolServiceError(f"{where}: {self._reason(err)}") from None
        if len(data) > self.max_reply_bytes:
            raise ToolServiceError(f"{where}: the reply is over {self.max_reply_bytes:,} bytes")
        try:
            reply = parse_json(data, "the reply", _REPLY_LIMITS, finite_only=True)
        except ClovaTrainError as err:
            raise ToolServiceError(f"{where}: {err}") from None
        if not isinstance(reply, dict):
            raise ToolServiceError(f"{where}: the reply is a JSON {type(reply).__name__}, not an object")
        return reply

    def _reason(self, reason: object) -> str:
        if isinstance(reason, ConnectionRefusedError):
            return "connection refused (is `clova-train serve` running at that address?)"
        if isinstance(reason, TimeoutError):
            return f"no answer within {self.timeout_s:g} s"
        if isinstance(reason, BaseException):
            return f"{type(reason).__name__}: {reason}"
        return str(reason)

    def close(self) -> None:
        """Nothing to release: each request opens its own connection."""

    def __repr__(self) -> str:  # without the API key
        return f"HttpToolClient({self.server_url!r}, roles={sorted(self.roles)})"


def _inlined(payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` with every image path of its image fields replaced by a ``data:`` URL of the file's bytes."""
    def inline(value: Any) -> Any:
        if not isinstance(value, str) or value.startswith("data:"):
            return value
        media_type = mimetypes.guess_type(value)[0]
        data = read_bytes(value, "image", MAX_SENT_IMAGE_BYTES)
        return as_data_url(data, media_type if media_type and media_type.startswith("image/") else None)

    inlined = dict(payload)
    for name in IMAGE_FIELDS:
        value = payload.get(name)
        if isinstance(value, list):
            inlined[name] = [inline(v) for v in value]
        elif value is not None:
            inlined[name] = inline(value)
    return inlined


def _error_message(err: urllib.error.HTTPError) -> str:
    """The server's message from an error reply (OpenAI's ``{"error": {"message"}}``, FastAPI's ``{"detail"}``), or
    the start of the body, or the status's reason."""
    try:
        body = err.read(64 << 10)
    except (OSError, HTTPException):
        body = b""
    try:
        parsed = json.loads(body.decode("utf-8", "replace")) if body else None
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        message = error.get("message") if isinstance(error, dict) else error if isinstance(error, str) else None
        message = message if isinstance(message, str) else parsed.get("detail")
        if isinstance(message, str) and message.strip():
            return " ".join(message.split())[:500]
    text = " ".join(body.decode("utf-8", "replace").split())[:200]
    return text or str(err.reason)
