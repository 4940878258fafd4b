"""OpenAI-compatible HTTP backends against a loopback stub server; the call cache; the hashing embedder."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from clova_train.llm.backends import BackendError, HashingEmbedder, OpenAIChatBackend, OpenAIEmbeddingBackend
from clova_train.envs.hydra.parts import PLACEHOLDER_INSTRUCTION, MemoryBank, Planner
from clova_train.llm.cache import CachedChat, CachedEmbedding, CallCache

Reply = tuple[int, bytes, float]  # status, body, delay in seconds


def chat_body(content: str) -> bytes:
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()


@pytest.fixture
def stub() -> Iterator[tuple[str, list[Reply], list[dict]]]:
    """A loopback server answering each POST with the next scripted reply; records the requests."""
    replies: list[Reply] = []
    received: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server API)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append({"path": self.path, "json": json.loads(body), "auth": self.headers.get("Authorization")})
            status, payload, delay = replies.pop(0) if replies else (500, b"no reply scripted", 0.0)
            time.sleep(delay)
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", replies, received
    server.shutdown()
    server.server_close()


def chat(url: str, **kwargs) -> OpenAIChatBackend:
    return OpenAIChatBackend(url, "stub-model", **{"backoff_s": 0.01, "timeout_s": 2.0, **kwargs})


def test_chat_request_and_reply(stub, monkeypatch: pytest.MonkeyPatch) -> None:
    url, replies, received = stub
    monkeypatch.setenv("STUB_KEY", "secret")
    replies.append((200, chat_body("hello"), 0.0))
    assert chat(url, api_key_env="STUB_KEY").chat([{"role": "user", "content": "hi"}]) == "hello"
    assert received[0]["path"] == "/v1/chat/completions" and received[0]["auth"] == "Bearer secret"
    assert received[0]["json"]["model"] == "stub-model" and received[0]["json"]["messages"][0]["content"] == "hi"


def test_timeout_is_retried_then_reported(stub) -> None:
    url, replies, received = stub
    replies.extend([(200, chat_body("late"), 1.0)] * 2)
    backend = chat(url, timeout_s=0.2, max_retries=1)
    with pytest.raises(BackendError, match=r"failed after 2 attempts; last error: timed out"):
        backend.chat([{"role": "user", "content": "hi"}])
    assert len(received) == 2


def test_5xx_is_retried_with_backoff(stub) -> None:
    url, replies, received = stub
    replies.extend([(503, b"busy", 0.0), (502, b"bad gateway", 0.0), (200, chat_body("finally"), 0.0)])
    started = time.perf_counter()
    assert chat(url, max_retries=3, backoff_s=0.05).chat([{"role": "user", "content": "hi"}]) == "finally"
    assert len(received) == 3 and time.perf_counter() - started >= 0.05 + 0.1  # 0.05 then 0.1


def test_4xx_is_not_retried(stub) -> None:
    url, replies, received = stub
    replies.append((401, b'{"error": "bad key"}', 0.0))
    with pytest.raises(BackendError, match="answered HTTP 401"):
        chat(url).chat([{"role": "user", "content": "hi"}])
    assert len(received) == 1


@pytest.mark.parametrize(("body", "message"), [
    (b"{not json", "malformed JSON reply"),
    (b'{"choices": []}', r"malformed chat reply, no choices\[0\].message.content"),
    (b'{"choices": [{"message": {"content": 3}}]}', "content is int"),
])
def test_malformed_replies_give_one_clear_error(stub, body: bytes, message: str) -> None:
    url, replies, _ = stub
    replies.extend([(200, body, 0.0)] * 2)
    with pytest.raises(BackendError, match=message):
        chat(url, max_retries=1).chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("lines", [2, 8])
def test_planner_reply_with_the_wrong_number_of_samples(stub, lines: int) -> None:
    url, replies, received = stub
    replies.append((200, chat_body("\n".join(f"{i + 1}. [0.{i + 1}] step {i + 1}" for i in range(lines))), 0.0))
    samples = Planner(chat(url), num_samples=5).propose("How many red circles are there?", MemoryBank(), 0)
    assert len(samples) == 5
    assert samples[: min(lines, 5)] == [(f"step {i + 1}", float(f"0.{i + 1}")) for i in range(min(lines, 5))]
    if lines < 5:
        assert samples[lines:] == [(PLACEHOLDER_INSTRUCTION, 0.0)] * (5 - lines)
    assert "Samples wanted: 5" in received[0]["json"]["messages"][-1]["content"]


def test_embeddings_are_ordered_and_checked(stub) -> None:
    url, replies, received = stub
    data = [{"index": 1, "embedding": [0.0, 1.0, 0.0]}, {"index": 0, "embedding": [1.0, 0.0, 0.0]}]
    replies.append((200, json.dumps({"data": data}).encode(), 0.0))
    backend = OpenAIEmbeddingBackend(url, "stub-embed", dim=3, backoff_s=0.01)
    np.testing.assert_array_equal(backend.embed(["a", "b"]), [[1, 0, 0], [0, 1, 0]])
    assert received[0]["path"] == "/v1/embeddings" and received[0]["json"]["input"] == ["a", "b"]
    replies.append((200, json.dumps({"data": data[:1]}).encode(), 0.0))
    with pytest.raises(BackendError, match=r"expected 2 embeddings of size 3, got shape \(1, 3\)"):
        backend.embed(["a", "b"])


def test_cache_replays_http_calls_without_the_server(stub, tmp_path: Path) -> None:
    url, replies, received = stub
    replies.append((200, chat_body("cached reply"), 0.0))
    messages = [{"role": "user", "content": "hi"}]
    recorder = CachedChat(chat(url), CallCache(tmp_path / "c.sqlite"))
    assert recorder.chat(messages) == "cached reply"
    replayer = CachedChat(chat(url), CallCache(tmp_path / "c.sqlite", mode="replay"))
    assert replayer.chat(messages) == "cached reply" and len(received) == 1
    assert replayer.cache.stats.hits == 1 and replayer.cache.stats.backend_calls == 0
    with pytest.raises(BackendError, match="replay mode"):  # a different request is a different key
        replayer.chat([{"role": "user", "content": "hello"}])
    with pytest.raises(BackendError, match="replay mode"):  # so is a different model
        CachedChat(chat(url, temperature=0.7), CallCache(tmp_path / "c.sqlite", mode="replay")).chat(messages)


def test_cached_embeddings_are_bit_identical(tmp_path: Path) -> None:
    embedder = CachedEmbedding(HashingEmbedder(32), CallCache(tmp_path / "e.sqlite"))
    first = embedder.embed(["find the red circle", "guess"])
    again = CachedEmbedding(HashingEmbedder(32), CallCache(tmp_path / "e.sqlite", mode="replay")).embed(
        ["guess", "find the red circle"])
    np.testing.assert_array_equal(first[::-1], again)
    np.testing.assert_allclose(np.linalg.norm(first, axis=1), 1.0, rtol=1e-6)


def test_local_transformers_backends_drive_the_environment(tiny_llama_dir: Path) -> None:
    """A local causal LM (e.g. a LoRA export) as planner/coder and embedder: its replies, however poor, are
    parsed into exactly N samples and the loop keeps running."""
    from clova_train.envs import ReasoningLoopConfig, ReasoningLoopEnv
    from clova_train.llm.backends import TransformersChatBackend, TransformersEmbeddingBackend

    llm = TransformersChatBackend(str(tiny_llama_dir), max_new_tokens=24)
    embedder = TransformersEmbeddingBackend(str(tiny_llama_dir))
    vectors = embedder.embed(["find the red circle", "guess"])
    assert vectors.shape == (2, embedder.dim) and np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    env = ReasoningLoopEnv(ReasoningLoopConfig(num_samples=3, max_iterations=2), llm=llm, embedder=embedder)
    try:
        obs, _ = env.reset(seed=0)
        assert obs.shape == env.observation_space.shape and len(env.samples) == 3
        _, _, terminated, truncated, info = env.step(0)
        assert info["status"] in ("ok", "error", "violation") and isinstance(info["code"], str)
    finally:
        env.close()


def test_hostile_planner_replies_stay_bounded_and_fast() -> None:
    from clova_train.envs.hydra.parts import MAX_INSTRUCTION_CHARS, parse_samples

    started = time.perf_counter()
    replies = ["1. [0.5] " + "x" * 10**7, "a" + " " * 200_000 + "b", "\n" * 10**6 + "1. [0.9] late",
               "[1e309] inf probability\n(p=-3) negative", "1. [0.5] bad \udc80 text"]
    for reply in replies:
        samples = parse_samples(reply, 5)
        assert len(samples) == 5 and all(len(text) <= MAX_INSTRUCTION_CHARS and 0 <= p <= 1 for text, p in samples)
    assert time.perf_counter() - started < 5
