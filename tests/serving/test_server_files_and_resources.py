"""The HTTP server reads no server file a client names unless the operator says so, and holds its resources
(issue 53, points 2 and 3).

In-process: :func:`confined_server_paths` on its own (no root: every server path refused; a root: paths confined to
it, symlinks resolved, and a path outside it refused without the file system being asked), the request guard's body
budget and streamed decompression driven as an ASGI app, and uvicorn with the bounded protocol in a thread in front of
the guard (slow connections closed at their deadlines or when the cap needs their place, good requests answered
while 1,000 slow ones are open, pipelined and kept-alive requests each authenticated).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import re
import resource
import socket
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from clova_train.serving.connections import ConnectionLimits, bounded_protocol, usable_connection_cap
from clova_train.serving.guard import RequestGuard, RequestLimits
from clova_train.tools import data_urls
from clova_train.tools.data_urls import ServerPathRefused, confined_server_paths

KEY = "k3y"
PNG_URL = "data:image/png;base64,iVBORw0KGgo="


# ------------------------------------------------------------------------------------------------ server files
def test_without_an_image_root_every_server_path_is_refused_and_data_urls_pass(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(b"x")
    for field, value in (("image", str(tmp_path / "a.png")), ("images", ["a.png"]), ("mask", "/etc/passwd"),
                         ("images", [PNG_URL, "/etc/hostname"])):
        with pytest.raises(ServerPathRefused, match="--image-root"):
            confined_server_paths({field: value}, None)
    request = {"images": [PNG_URL], "mask": PNG_URL, "labels": ["/etc/passwd"], "output": "x.png"}
    assert confined_server_paths(request, None) == request  # other fields are not paths the server reads


def test_an_image_root_confines_paths_and_resolves_symlinks(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "cats").mkdir(parents=True)
    outside.mkdir()
    (root / "cats" / "a.png").write_bytes(b"x")
    (outside / "secret.png").write_bytes(b"x")
    (root / "escape.png").symlink_to(outside / "secret.png")
    (root / "escape-dir").symlink_to(outside)
    real_root = Path(os.path.realpath(root))
    assert confined_server_paths({"image": "cats/a.png"}, real_root)["image"] == str(real_root / "cats" / "a.png")
    assert confined_server_paths({"images": [str(root / "cats" / "a.png")]}, real_root)["images"] == [
        str(real_root / "cats" / "a.png")]
    for name in ("../outside/secret.png", str(outside / "secret.png"), "/etc/passwd", "cats/../../outside/secret.png",
                 str(root) + "-sibling/x.png"):
        with pytest.raises(ServerPathRefused, match="outside the server's --image-root"):
            confined_server_paths({"image": name}, real_root)
    for name in ("escape.png", "escape-dir/secret.png"):
        with pytest.raises(ServerPathRefused, match="symbolic link"):
            confined_server_paths({"mask": name}, real_root)
    with pytest.raises(ServerPathRefused, match="not a file name"):
        confined_server_paths({"image": "a\x00.png"}, real_root)


def test_a_path_outside_the_root_is_refused_before_the_file_system_is_asked(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    def realpath(path: str) -> str:
        asked.append(path)
        return path

    monkeypatch.setattr(data_urls.os.path, "realpath", realpath)
    for name in ("/etc/passwd", "/no/such/file.png", "../../etc/shadow"):
        with pytest.raises(ServerPathRefused):
            confined_server_paths({"image": name}, tmp_path)
    assert asked == []  # same answer, same work, whether the file exists or not


# ------------------------------------------------------------------------------------------------ the guard's bodies
class Slow:
    """An app that holds each request until released, so bodies stay in flight."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def __call__(self, scope: dict, receive, send) -> None:
        await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def test_bodies_in_flight_are_bounded_and_given_back() -> None:
    body = json.dumps({"images": ["x" * 3000]}).encode()
    app = Slow()
    guard = RequestGuard(app, None, RequestLimits(max_body_bytes=4096, max_inflight_body_bytes=8000))

    async def one(replies: list) -> None:
        sent: list[dict] = []
        chunks = [body[:1000], body[1000:]]

        async def receive() -> dict:
            if not chunks:
                await asyncio.sleep(3600)
            chunk = chunks.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/clip",
                 "headers": [(b"content-type", b"application/json")]}
        await guard(scope, receive, send)
        replies.append(sent)

    async def scenario() -> list:
        replies: list = []
        tasks = [asyncio.create_task(one(replies)) for _ in range(3)]
        await asyncio.sleep(0.05)
        refused = list(replies)  # the third body would pass 8,000 bytes: answered at once
        app.release.set()
        await asyncio.gather(*tasks)
        assert guard.budget.held == 0
        await one(replies)  # given back: a new request is read again
        return refused, replies[-1]

    refused, after = asyncio.run(scenario())
    start = refused[0][0]
    assert len(refused) == 1 and start["status"] == 503
    assert (b"retry-after", b"1") in start["headers"] and (b"connection", b"close") in start["headers"]
    assert after[0]["status"] == 200


def test_a_compressed_chunked_body_is_refused_by_the_chunk_that_passes_the_limit() -> None:
    bomb = gzip.compress(b"0" * (4 << 20))
    pieces = [bomb[i:i + 256] for i in range(0, len(bomb), 256)]
    read = [0]
    guard = RequestGuard(Slow(), None, RequestLimits(max_body_bytes=65536))

    async def receive() -> dict:
        read[0] += 1
        return {"type": "http.request", "body": pieces[read[0] - 1], "more_body": read[0] < len(pieces)}

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/clip", "headers": [(b"content-encoding", b"gzip")]}
    asyncio.run(guard(scope, receive, send))
    assert sent[0]["status"] == 413 and read[0] <= 2, (read[0], len(pieces))
    assert guard.budget.held == 0


def test_a_deflate_body_within_the_limit_is_read_whole() -> None:
    payload = json.dumps({"labels": ["a"] * 5}).encode()
    packed = zlib.compress(payload)
    seen: list[bytes] = []

    async def app(scope: dict, receive, send) -> None:
        seen.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    guard = RequestGuard(app, None, RequestLimits(max_body_bytes=4096))
    pieces = [packed[:5], packed[5:]]

    async def receive() -> dict:
        return {"type": "http.request", "body": pieces.pop(0), "more_body": bool(pieces)}

    async def send(message: dict) -> None:
        pass

    asyncio.run(guard({"type": "http", "method": "POST", "path": "/v1/clip",
                       "headers": [(b"content-encoding", b"deflate")]}, receive, send))
    assert json.loads(seen[0]) == json.loads(payload)


# ------------------------------------------------------------------------------------------------ connections
async def echo(scope: dict, receive, send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            pass
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"ok": true}'})


@contextmanager
def bounded_server(limits: ConnectionLimits) -> Iterator[int]:
    """The guard (with an API key) and an echo app behind uvicorn with the bounded protocol, in a thread."""
    import uvicorn

    app = RequestGuard(echo, KEY, RequestLimits(max_body_bytes=4096))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, http=bounded_protocol(limits), log_level="critical", timeout_keep_alive=5,
                            lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def exchange(port: int, data: bytes, timeout: float = 5) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        received = b""
        while True:
            try:
                piece = sock.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not piece:
                break
            received += piece
        return received


def post(key: str | None, body: bytes = b"{}", close: bool = False) -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (f"POST /v1/clip HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{'Connection: close' + chr(13) + chr(10) if close else ''}\r\n").encode() + body


def closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_pipelined_and_kept_alive_requests_are_each_authenticated() -> None:
    with bounded_server(ConnectionLimits(64, 2.0, 2.0)) as port:
        replies = exchange(port, post(KEY) + post(None) + post(KEY, close=True), timeout=3)
        statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", replies)
        assert statuses == [b"200", b"401", b"200"], replies  # each meets the key check; the 401 keeps the connection


def test_slow_headers_and_bodies_are_closed_at_their_deadlines() -> None:
    with bounded_server(ConnectionLimits(64, 0.5, 0.5)) as port:
        started = time.monotonic()
        partial = socket.create_connection(("127.0.0.1", port))
        partial.sendall(b"POST /v1/clip HTTP/1.1\r\nHost: x\r\n")
        trickling = socket.create_connection(("127.0.0.1", port))
        body = socket.create_connection(("127.0.0.1", port))
        body.sendall(post(KEY, b'{"a": 1}')[:-3])
        for _ in range(3):  # a byte at a time does not move the header deadline
            trickling.sendall(b"X")
            time.sleep(0.1)
        for sock in (partial, trickling, body):
            assert closed_within(sock, 2.0)
            sock.close()
        assert time.monotonic() - started < 3
        assert b"200 OK" in exchange(port, post(KEY, close=True))


def test_good_requests_are_answered_while_a_thousand_slow_connections_are_open() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2400:
        pytest.skip(f"the open-file hard limit ({hard}) leaves no room for 1,100 connections on both ends")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2400) if hard == resource.RLIM_INFINITY else hard, hard))
    slow: list[socket.socket] = []
    try:
        with bounded_server(ConnectionLimits(1024, 30.0, 30.0)) as port:
            for _ in range(1100):  # more than the cap: the longest-waiting ones are closed for new ones
                sock = socket.create_connection(("127.0.0.1", port))
                sock.sendall(b"POST /v1/clip HTTP/1.1\r\nHost: x\r\n")
                slow.append(sock)
            started = time.monotonic()
            for _ in range(3):
                assert b"200 OK" in exchange(port, post(KEY, close=True))
            assert time.monotonic() - started < 5
            assert closed_within(slow[0], 2.0)  # the oldest slow one gave its place
    finally:
        for sock in slow:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_connection_cap_stays_below_the_open_file_limit() -> None:
    assert usable_connection_cap(4096, 1024) == 960
    assert usable_connection_cap(100, 1 << 20) == 100
    with pytest.raises(ValueError, match="header_timeout_s"):
        ConnectionLimits(header_timeout_s=0)
