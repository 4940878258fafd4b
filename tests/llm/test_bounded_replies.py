"""Every HTTP client of the package bounds a reply after decompression: a gzip or deflate bomb (with a length, or
chunked with none, or in layers) fails like an oversized reply, an encoding not asked for is refused, and a small
compressed reply is still read. Raw-HTTP server in a thread on 127.0.0.1 (tests/llm/test_http_faults.py's)."""

from __future__ import annotations

import gzip
import json
import socket
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterator

import pytest

from clova_train.core.errors import ToolServiceError
from clova_train.llm.backends import BackendError, OpenAIChatBackend
from clova_train.llm.search import HttpSearchBackend
from clova_train.tools.tool_clients import HttpToolClient
from test_http_faults import FaultServer, send

LIMIT = 256 << 10
BOMB_BYTES = 16 << 20  # 16 MiB of zeros: about 16 KB gzipped, 64 times the limit


def deflate_raw(data: bytes) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


ZEROS = b"\0" * BOMB_BYTES
BOMBS = {
    "gzip": (gzip.compress(ZEROS, 9), "gzip"),
    "x-gzip": (gzip.compress(ZEROS, 9), "x-gzip"),
    "deflate (zlib)": (zlib.compress(ZEROS, 9), "deflate"),
    "deflate (raw)": (deflate_raw(ZEROS), "deflate"),
    "gzip of gzip": (gzip.compress(gzip.compress(ZEROS, 9), 9), "gzip, gzip"),
}
del ZEROS


def reply(body: bytes, encoding: str | None, chunked: bool = False) -> bytes:
    head = ["HTTP/1.1 200 OK", "Content-Type: application/json", "Connection: close"]
    head += [f"Content-Encoding: {encoding}"] if encoding else []
    if chunked:
        head.append("Transfer-Encoding: chunked")
        pieces = [body[i:i + 8192] for i in range(0, len(body), 8192)]
        body = b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in pieces) + b"0\r\n\r\n"
    else:
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


@pytest.fixture
def server() -> Iterator[FaultServer]:
    fault_server = FaultServer()
    yield fault_server
    fault_server.stop()


def chat(server: FaultServer) -> Callable[[], object]:
    backend = OpenAIChatBackend(server.url, "stub", timeout_s=5.0, max_retries=0, deadline_s=10.0,
                                max_reply_bytes=LIMIT)
    return lambda: backend.chat([{"role": "user", "content": "hi"}])


def search(server: FaultServer) -> Callable[[], object]:
    backend = HttpSearchBackend(text_search_url=server.url + "/search", timeout_s=5.0, max_retries=0, deadline_s=10.0,
                                max_reply_bytes=LIMIT)
    return lambda: backend.search("text_search", "q")


CLIENTS = {"chat": (chat, BackendError), "search": (search, BackendError)}


@pytest.mark.parametrize("chunked", [False, True], ids=["with length", "chunked"])
@pytest.mark.parametrize("bomb", sorted(BOMBS))
@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_a_compressed_bomb_fails_within_the_limit(server: FaultServer, client: str, bomb: str, chunked: bool) -> None:
    body, encoding = BOMBS[bomb]
    server.behaviours.append(send(reply(body, encoding, chunked)))
    make, error = CLIENTS[client]
    call = make(server)
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(error, match="larger than"):
            call()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - started < 5
    assert peak < 16 * LIMIT, f"{peak:,} bytes held while decoding"
    assert "gzip" in server.requests[0]["headers"].get("accept-encoding", "") or client == "search"


@pytest.mark.parametrize("encoding", ["br", "zstd", "compress", "gzip, gzip, gzip, gzip"])
@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_an_encoding_not_asked_for_is_refused(server: FaultServer, client: str, encoding: str) -> None:
    server.behaviours.append(send(reply(b"\x0b\x02\x80{}\x03", encoding)))
    make, error = CLIENTS[client]
    with pytest.raises(error, match="Content-Encoding"):
        make(server)()


@pytest.mark.parametrize("encoding", ["gzip", "deflate", None])
def test_a_small_compressed_reply_is_read(server: FaultServer, encoding: str | None) -> None:
    body = json.dumps({"choices": [{"message": {"role": "assistant", "content": "fine"}}]}).encode()
    packed = {"gzip": gzip.compress, "deflate": zlib.compress, None: lambda b: b}[encoding](body)
    server.behaviours.append(send(reply(packed, encoding, chunked=True)))
    assert chat(server)() == "fine"
    results = json.dumps({"results": ["a cat"]}).encode()
    server.behaviours.append(send(reply({"gzip": gzip.compress, "deflate": zlib.compress, None: lambda b: b}[encoding](
        results), encoding)))
    assert search(server)() == "a cat"


def test_broken_compressed_data_is_one_clear_error(server: FaultServer) -> None:
    server.behaviours.append(send(reply(b"\x1f\x8b\x08\x00garbage" * 10, "gzip")))
    with pytest.raises(BackendError, match="not valid gzip data"):
        chat(server)()


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
def test_the_tool_client_refuses_a_compressed_reply_it_did_not_ask_for(server: FaultServer, encoding: str) -> None:
    """urllib asks for ``identity`` and never decompresses: a compressed reply is refused by name, never inflated."""
    server.behaviours.append(send(reply(gzip.compress(b"{}" + b" " * 1000), encoding)))
    client = HttpToolClient(server.url.removesuffix("/v1"), {"CLASSIFY": "clip"}, timeout_s=5.0)
    with pytest.raises(ToolServiceError, match=f"Content-Encoding '{encoding}'"):
        client.request("CLASSIFY", {"labels": ["a"]})
    assert server.requests[0]["headers"].get("accept-encoding", "identity") == "identity"
