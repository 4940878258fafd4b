"""The OpenAI-compatible backend against a fault-injecting HTTP server on 127.0.0.1.

The server speaks raw HTTP/1.1 over a socket, so it can send what a well-behaved server never would: bad status
lines, truncated and non-UTF-8 bodies, one byte at a time. It serves a bounded number of connections, each with
a time limit, and stops by itself. Every fault must end in one BackendError (or a retry, then success) within
the client's deadline, and the API key must never reach another port.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from clova_train.llm.backends import BackendError, OpenAIChatBackend, OpenAIEmbeddingBackend

Behaviour = Callable[[socket.socket], None]
MAX_CONNECTIONS = 50
CONNECTION_LIMIT_S = 5.0


def response(status: str, body: bytes, headers: dict[str, str] | None = None, length: int | None = None) -> bytes:
    lines = [f"HTTP/1.1 {status}", f"Content-Length: {len(body) if length is None else length}",
             "Content-Type: application/json", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def send(raw: bytes) -> Behaviour:
    return lambda conn: conn.sendall(raw)


def drip(raw: bytes, every_s: float) -> Behaviour:
    def behave(conn: socket.socket) -> None:
        started = time.monotonic()
        for byte in raw:
            if time.monotonic() - started > CONNECTION_LIMIT_S:
                return
            conn.sendall(bytes([byte]))
            time.sleep(every_s)
    return behave


def chat_ok(text: str = "fine") -> bytes:
    return response("200 OK", json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode())


class FaultServer:
    """A bounded raw-HTTP server: each connection takes the next behaviour; records requests and headers."""

    def __init__(self) -> None:
        self.behaviours: list[Behaviour] = []
        self.requests: list[dict] = []
        self.connections = 0
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                server.connections += 1
                if server.connections > MAX_CONNECTIONS:
                    return
                self.request.settimeout(CONNECTION_LIMIT_S)
                try:
                    data = b""
                    while b"\r\n\r\n" not in data:
                        chunk = self.request.recv(65536)
                        if not chunk:
                            return
                        data += chunk
                    head, body = data.split(b"\r\n\r\n", 1)
                    lines = head.decode("latin-1").split("\r\n")
                    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
                    while len(body) < int(headers.get("content-length", 0)):
                        body += self.request.recv(65536)
                    server.requests.append({"line": lines[0], "headers": headers, "body": body})
                    behaviour = server.behaviours.pop(0) if server.behaviours else send(response("500 X", b"none"))
                    behaviour(self.request)
                except OSError:
                    pass

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def server() -> Iterator[FaultServer]:
    fault_server = FaultServer()
    yield fault_server
    fault_server.stop()


@pytest.fixture
def other_server() -> Iterator[FaultServer]:
    fault_server = FaultServer()
    yield fault_server
    fault_server.stop()


def backend(url: str, **kwargs) -> OpenAIChatBackend:
    options = {"api_key": "sk-test-key", "timeout_s": 1.0, "max_retries": 2, "backoff_s": 0.01, "deadline_s": 3.0}
    return OpenAIChatBackend(url, "stub-model", **{**options, **kwargs})


def ask(chat: OpenAIChatBackend) -> str:
    return chat.chat([{"role": "user", "content": "hi"}])


def timed_failure(chat: OpenAIChatBackend, match: str) -> float:
    started = time.monotonic()
    with pytest.raises(BackendError, match=match) as caught:
        ask(chat)
    assert chat.client.base_url in str(caught.value)  # the message names the server
    return time.monotonic() - started


@pytest.mark.parametrize(("name", "raw", "match"), [
    ("400", response("400 Bad Request", b'{"error": "bad"}'), "answered HTTP 400"),
    ("401", response("401 Unauthorized", b'{"error": "key"}'), "answered HTTP 401"),
])
def test_client_errors_are_not_retried(server: FaultServer, name: str, raw: bytes, match: str) -> None:
    server.behaviours.append(send(raw))
    timed_failure(backend(server.url), match)
    assert len(server.requests) == 1


@pytest.mark.parametrize(("name", "raw", "match"), [
    ("500", response("500 Internal Server Error", b"boom"), "HTTP 500"),
    ("malformed JSON", response("200 OK", b"{not json"), "malformed JSON reply"),
    ("HTML", response("200 OK", b"<html><body>Bad gateway</body></html>", {"Content-Type": "text/html"}),
     "malformed JSON reply"),
    ("empty", response("200 OK", b""), "malformed JSON reply"),
    ("JSON array", response("200 OK", b"[1, 2]"), "expected a JSON object"),
    ("truncated", response("200 OK", b'{"choices": [', length=500), "connection failed"),
    ("non-UTF-8", response("200 OK", b'{"choices": "\xff\xfe\xfa"}'), "not UTF-8"),
    ("bad status line", b"HTTP/1.1 abc\r\n\r\n", "connection failed"),
    ("garbage status line", b"SSH-2.0-OpenSSH\r\n\r\n", "connection failed"),
    ("closed without reply", b"", "connection failed"),
])
def test_faults_are_retried_then_one_clear_error(server: FaultServer, name: str, raw: bytes, match: str) -> None:
    server.behaviours.extend([send(raw)] * 3)
    elapsed = timed_failure(backend(server.url), match)
    assert len(server.requests) == 3 and elapsed < 3.5


def test_a_fault_then_success_is_retried(server: FaultServer) -> None:
    server.behaviours.extend([send(response("503 Busy", b"")), send(b"HTTP/1.1 ??\r\n\r\n"), send(chat_ok("done"))])
    assert ask(backend(server.url)) == "done" and len(server.requests) == 3


def test_retry_after_is_honoured(server: FaultServer) -> None:
    server.behaviours.extend([send(response("429 Too Many Requests", b"{}", {"Retry-After": "0.6"})),
                              send(chat_ok("after waiting"))])
    started = time.monotonic()
    assert ask(backend(server.url)) == "after waiting"
    assert time.monotonic() - started >= 0.6 and len(server.requests) == 2


def test_retry_after_in_milliseconds_is_honoured(server: FaultServer) -> None:
    server.behaviours.extend([send(response("429 Too Many Requests", b"{}", {"retry-after-ms": "400"})),
                              send(chat_ok())])
    started = time.monotonic()
    ask(backend(server.url))
    assert time.monotonic() - started >= 0.4


def test_retry_after_past_the_deadline_fails_at_once(server: FaultServer) -> None:
    server.behaviours.append(send(response("429 Too Many Requests", b"{}", {"Retry-After": "3600"})))
    elapsed = timed_failure(backend(server.url), "asked to retry after 3600 s, past the 3 s deadline")
    assert elapsed < 1.0 and len(server.requests) == 1


@pytest.mark.parametrize("what", ["body", "headers"])
def test_a_drip_fed_reply_is_cut_off_at_the_deadline(server: FaultServer, what: str) -> None:
    raw = chat_ok("x" * 200)
    head, body = raw.split(b"\r\n\r\n", 1)
    # each byte comes well inside the per-operation timeout, so only the total deadline can stop it
    if what == "headers":
        behaviour = drip(raw, 0.05)
    else:
        def behaviour(conn: socket.socket) -> None:
            conn.sendall(head + b"\r\n\r\n")
            drip(body, 0.05)(conn)
    server.behaviours.extend([behaviour] * 3)
    chat = backend(server.url, timeout_s=1.0, deadline_s=1.5)
    elapsed = timed_failure(chat, "timed out|deadline")
    assert elapsed < 1.5 + 0.5


def test_redirects_are_not_followed_and_the_key_stays_home(server: FaultServer, other_server: FaultServer) -> None:
    for status in ("307 Temporary Redirect", "302 Found", "301 Moved Permanently"):
        server.behaviours.append(send(response(status, b"", {"Location": f"{other_server.url}/chat/completions"})))
        timed_failure(backend(server.url), "redirects are not followed")
    assert other_server.requests == [] and other_server.connections == 0
    assert all(r["headers"]["authorization"] == "Bearer sk-test-key" for r in server.requests)
    assert all(r["line"].startswith("POST ") for r in server.requests)


def test_connection_refused_is_one_clear_error() -> None:
    with socket.socket() as probe:  # a port with nothing listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    timed_failure(backend(f"http://127.0.0.1:{port}/v1", max_retries=1), "connection failed")


@pytest.mark.parametrize("vector", ["[NaN, 0.0]", "[Infinity, 1.0]", "[-Infinity, 1.0]", '["NaN", 1.0]'])
def test_non_finite_embeddings_are_refused(server: FaultServer, vector: str) -> None:
    body = f'{{"data": [{{"index": 0, "embedding": {vector}}}]}}'.encode()
    server.behaviours.append(send(response("200 OK", body)))
    embedder = OpenAIEmbeddingBackend(server.url, "stub-embed", dim=2, api_key="k", timeout_s=1.0, max_retries=0)
    with pytest.raises(BackendError, match="non-finite|malformed embedding"):
        embedder.embed(["a"])
    assert json.loads(server.requests[0]["body"])["encoding_format"] == "float"


def test_lone_surrogates_are_made_well_formed_both_ways(server: FaultServer) -> None:
    server.behaviours.append(send(response("200 OK", b'{"choices": [{"message": {"content": "bad \\ud800 text"}}]}')))
    reply = backend(server.url).chat([{"role": "user", "content": "hi \udc80"}])
    assert reply == "bad ? text" and reply.encode("utf-8")
    sent = json.loads(server.requests[0]["body"])["messages"][0]["content"]
    assert sent == "hi ?"


def test_an_endless_reply_is_cut_off_by_size(server: FaultServer) -> None:
    def flood(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n")
        chunk = b"x" * 65536
        for _ in range(200):  # 13 MB, well past the 1 MB limit below
            conn.sendall(chunk)

    server.behaviours.extend([flood] * 2)
    timed_failure(backend(server.url, max_retries=1, max_reply_bytes=1 << 20), "larger than 1048576 bytes")
