"""LLM and embedding backends for the reasoning loop: OpenAI-compatible HTTP, local transformers, offline.

* :class:`OpenAIChatBackend` / :class:`OpenAIEmbeddingBackend`: any server speaking the OpenAI REST API
  (vLLM, Ollama, OpenAI). Base URL, model and key come from the config; the key may instead name an
  environment variable. Built on the ``openai`` SDK (see :class:`OpenAICompatibleClient`): per-operation
  timeouts, a total deadline per call, retries honouring ``Retry-After``, no redirects, and one clear
  :class:`BackendError` naming the URL for anything else (4xx, malformed or non-UTF-8 bodies, a reply without
  the expected fields, non-finite embeddings). Replies are validated before they reach a cache or a prompt.
  Replies are bounded twice: the bytes read from the socket (headers, chunked framing and all), and the bytes a
  compressed reply decompresses to (:class:`_BoundedDecoding`: ``gzip`` and ``deflate`` are the encodings asked
  for and decoded, a piece at a time; a reply in any other encoding is refused), so a small gzip or deflate bomb
  fails like an oversized reply instead of filling memory.
* :class:`TransformersChatBackend` / :class:`TransformersEmbeddingBackend`: a local Hugging Face model
  directory (for instance one exported by ``clova-train export --merged`` after LoRA fine-tuning).
* :class:`HashingEmbedder`: signed feature hashing of word uni- and bigrams; offline, deterministic, fast.

Every backend has an ``identity()`` (what it is, never the key): the cache keys calls by it and by the
full request, so a recorded run replays exactly.
"""

from __future__ import annotations

import email.utils
import json
import math
import os
import threading
import time
import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import httpcore2
import httpx2
import numpy as np

from clova_train.core.errors import ClovaTrainError
from clova_train.core.observation_builder import hashing_embedding

Message = dict[str, str]


class BackendError(ClovaTrainError):
    """An LLM or embedding backend failed or replied with something unusable."""


class ChatBackend(ABC):
    """Replies to a list of chat messages (``{"role", "content"}``)."""

    @abstractmethod
    def identity(self) -> dict[str, Any]:
        """What produces the replies (kind, model, sampling parameters): part of every cache key."""

    @abstractmethod
    def chat(self, messages: list[Message]) -> str:
        """The assistant's reply text."""


class EmbeddingBackend(ABC):
    """Maps texts to float32 vectors of a fixed dimension."""

    dim: int

    @abstractmethod
    def identity(self) -> dict[str, Any]:
        """What produces the vectors: part of every cache key."""

    @abstractmethod
    def embed(self, texts: list[str]) -> np.ndarray:
        """``[len(texts), dim]`` float32."""


def well_formed(text: str) -> str:
    """``text`` with lone surrogates replaced, so that it can be encoded (sent, tokenised, hashed) as UTF-8."""
    if text.isascii():
        return text
    return text.encode("utf-8", "replace").decode("utf-8")


def ask(backend: ChatBackend, messages: list[Message]) -> str:
    """``backend``'s reply to ``messages`` as well-formed text, before anything parses it: a lone surrogate
    becomes U+FFFD, and a reply that is not text at all is a :class:`BackendError`."""
    reply = backend.chat(messages)
    if not isinstance(reply, str):
        raise BackendError(f"chat backend {type(backend).__name__} replied with {type(reply).__name__}, not text")
    return well_formed(reply)


# ------------------------------------------------------------------------------------------------ HTTP


class _Deadline:
    """The monotonic time by which the current request (retries included) must be done, and the bytes it may
    still read, per thread."""

    def __init__(self, max_reply_bytes: int) -> None:
        self._local = threading.local()
        self.max_reply_bytes = max_reply_bytes

    def set(self, when: float | None) -> None:
        self._local.when = when
        self._local.budget = self.max_reply_bytes

    def spend(self, count: int) -> None:
        self._local.budget = getattr(self._local, "budget", self.max_reply_bytes) - count
        if self._local.budget < 0:
            raise httpcore2.ReadError(f"the reply is larger than {self.max_reply_bytes} bytes")

    def bound(self, timeout: float | None) -> float | None:
        when = getattr(self._local, "when", None)
        if when is None:
            return timeout
        remaining = when - time.monotonic()
        if remaining <= 0:
            raise httpcore2.ReadTimeout("the request's total deadline has passed")
        return remaining if timeout is None else min(timeout, remaining)


class _DeadlineStream(httpcore2.NetworkStream):
    """A network stream whose every read and write waits at most until the request's deadline."""

    def __init__(self, inner: httpcore2.NetworkStream, deadline: _Deadline) -> None:
        self.inner, self.deadline = inner, deadline

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        data = self.inner.read(max_bytes, self.deadline.bound(timeout))
        self.deadline.spend(len(data))
        return data

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.inner.write(buffer, self.deadline.bound(timeout))

    def close(self) -> None:
        self.inner.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore2.NetworkStream:
        return _DeadlineStream(self.inner.start_tls(ssl_context, server_hostname, self.deadline.bound(timeout)),
                               self.deadline)

    def get_extra_info(self, info: str) -> Any:
        return self.inner.get_extra_info(info)


class _DeadlineNetwork(httpcore2.SyncBackend):
    """httpcore's socket backend, with connects, reads and writes bounded by the request's deadline.

    Per-operation timeouts cannot stop a server that sends one byte just inside each timeout; bounding every
    socket operation by the time left to the whole request does, headers included.
    """

    def __init__(self, deadline: _Deadline) -> None:
        self.deadline = deadline

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Any = None) -> httpcore2.NetworkStream:
        stream = super().connect_tcp(host, port, self.deadline.bound(timeout), local_address, socket_options)
        return _DeadlineStream(stream, self.deadline)


ACCEPTED_ENCODINGS = ("gzip", "x-gzip", "deflate")  # what _BoundedDecoding decodes (x-gzip: gzip's old name)
ACCEPT_ENCODING = "gzip, deflate"
MAX_ENCODINGS = 3  # gzip of gzip of gzip at most
_DECODE_PIECE = 64 << 10  # most bytes one decompression step produces


class _Inflater:
    """One ``gzip`` / ``deflate`` layer, decompressing at most :data:`_DECODE_PIECE` bytes per step (a few bytes of
    a bomb never expand at once). ``deflate`` is zlib-wrapped as the RFC says, or raw as some servers send it."""

    def __init__(self, coding: str) -> None:
        self.coding = coding
        self.started = False
        self.inflater = zlib.decompressobj(zlib.MAX_WBITS | 16 if coding != "deflate" else zlib.MAX_WBITS)

    def feed(self, data: bytes) -> Iterator[bytes]:
        try:
            piece = self.inflater.decompress(data, _DECODE_PIECE)
        except zlib.error:
            if self.coding != "deflate" or self.started:
                raise
            self.inflater = zlib.decompressobj(-zlib.MAX_WBITS)
            piece = self.inflater.decompress(data, _DECODE_PIECE)
        self.started = True
        while piece:
            yield piece
            piece = self.inflater.decompress(self.inflater.unconsumed_tail, _DECODE_PIECE)

    def finish(self) -> Iterator[bytes]:
        yield from self.feed(b"")
        yield self.inflater.flush()


class _DecodedStream(httpx2.SyncByteStream):
    """A reply's raw body decoded layer by layer, failing once it passes ``max_bytes`` decoded bytes."""

    def __init__(self, raw: Any, codings: list[str], max_bytes: int, request: httpx2.Request) -> None:
        self.raw, self.codings, self.max_bytes, self.request = raw, codings, max_bytes, request

    def __iter__(self) -> Iterator[bytes]:
        layers = [_Inflater(coding) for coding in reversed(self.codings)]  # the last encoding applied comes off first
        produced = 0
        try:
            for piece in self._decoded(iter(self.raw), layers):
                produced += len(piece)
                if produced > self.max_bytes:
                    raise httpx2.DecodingError(f"the reply is larger than {self.max_bytes} bytes once decompressed "
                                               f"({', '.join(self.codings)})", request=self.request)
                yield piece
        except zlib.error as err:
            raise httpx2.DecodingError(f"the reply is not valid {', '.join(self.codings)} data ({err})",
                                       request=self.request) from None

    @staticmethod
    def _decoded(chunks: Iterator[bytes], layers: list[_Inflater]) -> Iterator[bytes]:
        if not layers:
            yield from chunks
            return
        layer, rest = layers[0], layers[1:]

        def through_layer() -> Iterator[bytes]:
            for chunk in chunks:
                yield from layer.feed(chunk)
            yield from layer.finish()

        yield from (piece for piece in _DecodedStream._decoded(through_layer(), rest) if piece)

    def close(self) -> None:
        self.raw.close()


class _BoundedDecoding(httpx2.BaseTransport):
    """A transport that asks for ``gzip, deflate`` and decodes the reply itself, at most ``max_bytes`` of it
    (httpx would decode a whole non-streamed reply into memory, whatever its compressed size). A reply in an
    encoding not asked for (``br``, ``zstd``, ``compress``, or more than :data:`MAX_ENCODINGS` layers) is an
    ``httpx.DecodingError``. A request that asks for ``identity`` keeps asking for it."""

    def __init__(self, inner: httpx2.BaseTransport, max_bytes: int) -> None:
        self.inner, self.max_bytes = inner, max_bytes

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        if request.headers.get("accept-encoding", "").strip().lower() != "identity":
            request.headers["Accept-Encoding"] = ACCEPT_ENCODING
        response = self.inner.handle_request(request)
        codings = [c.strip().lower() for c in response.headers.get_list("content-encoding", split_commas=True)]
        codings = [c for c in codings if c and c != "identity"]
        if not codings:
            return response
        if len(codings) > MAX_ENCODINGS or any(c not in ACCEPTED_ENCODINGS for c in codings):
            response.close()
            raise httpx2.DecodingError(f"the reply's Content-Encoding {', '.join(codings)[:80]!r} is not one this "
                                       f"client accepts ({ACCEPT_ENCODING}, at most {MAX_ENCODINGS} layers)",
                                       request=request)
        headers = [(k, v) for k, v in response.headers.raw if k.lower() not in (b"content-encoding", b"content-length")]
        return httpx2.Response(response.status_code, headers=headers, request=request, extensions=response.extensions,
                               stream=_DecodedStream(response.stream, codings, self.max_bytes, request))

    def close(self) -> None:
        self.inner.close()


def _transport(deadline: _Deadline) -> httpx2.BaseTransport:
    transport = httpx2.HTTPTransport(trust_env=False)
    # httpx's transport takes no network backend argument; its pool does. Same pool settings, our backend.
    transport._pool = httpcore2.ConnectionPool(ssl_context=httpx2.create_ssl_context(trust_env=False),
                                               network_backend=_DeadlineNetwork(deadline))
    return _BoundedDecoding(transport, deadline.max_reply_bytes)


def _retry_after(headers: Any) -> float | None:
    """Seconds the server asked us to wait (``retry-after-ms``, ``retry-after`` in seconds or as an HTTP date)."""
    for name, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name) if headers is not None else None
        if value is None:
            continue
        try:
            seconds = float(value) / scale
        except ValueError:
            try:
                seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
            except (TypeError, ValueError, IndexError):
                continue
        if math.isfinite(seconds):
            return max(0.0, seconds)
    return None


class OpenAICompatibleClient:
    """JSON POSTs to an OpenAI-compatible server (vLLM, Ollama, OpenAI) through the ``openai`` SDK.

    The SDK builds and sends the request (auth header, timeouts, its error classes); replies are read raw and
    validated here (strict UTF-8 JSON object), so that a malformed reply is one :class:`BackendError`, never a
    half-built object. Retries are ours, with the SDK's rule (connection errors, timeouts, 408, 409, 429,
    5xx; also malformed replies), because the SDK's own retry loop cannot bound the total time of a call:
    every call ends within ``deadline_s``, retries, ``Retry-After`` waits and slow (drip-fed) replies
    included. ``Retry-After`` / ``retry-after-ms`` are honoured; a wait past the deadline fails at once.
    Redirects are not followed, so the key never goes to another origin.

    Args:
        base_url: e.g. ``http://localhost:8000/v1``.
        api_key: the key itself; if empty, read from the environment variable ``api_key_env``.
        api_key_env: environment variable holding the key (``EMPTY`` is sent if it is unset, as vLLM expects).
        timeout_s: limit of each network operation (connect, each read, each write).
        max_retries: retries after the first attempt.
        backoff_s: first retry delay when the server gives none; doubled for each further retry.
        deadline_s: total time of one call, retries included (default: ``timeout_s * (max_retries + 1)``).
        max_reply_bytes: largest reply read (a larger one is cut off and counts as a failed attempt).
    """

    RETRYABLE_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})

    def __init__(self, base_url: str, api_key: str = "", api_key_env: str = "OPENAI_API_KEY",
                 timeout_s: float = 30.0, max_retries: int = 3, backoff_s: float = 0.5,
                 deadline_s: float | None = None, max_reply_bytes: int = 64 << 20) -> None:
        from openai import OpenAI

        self.base_url = base_url.rstrip("/")
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s
        self.deadline_s = deadline_s if deadline_s is not None else timeout_s * (max_retries + 1)
        self.requests = 0
        self._deadline = _Deadline(max_reply_bytes)
        http_client = httpx2.Client(transport=_transport(self._deadline), follow_redirects=False, trust_env=False,
                                    timeout=timeout_s)
        self._sdk = OpenAI(base_url=self.base_url, api_key=api_key or os.environ.get(api_key_env, "") or "EMPTY",
                           max_retries=0, timeout=timeout_s, http_client=http_client)

    def post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        """The JSON object the server replied with, or :class:`BackendError` naming the URL."""
        from openai import APIConnectionError, APIStatusError, APITimeoutError

        url = f"{self.base_url}/{path.lstrip('/')}"
        deadline = time.monotonic() + self.deadline_s
        failure = ""
        try:
            for attempt in range(self.max_retries + 1):
                self.requests += 1
                wait = self.backoff_s * 2**attempt
                self._deadline.set(deadline)
                try:
                    response = self._sdk.post(path, cast_to=httpx2.Response, body=payload)
                    return self._parse(response.content)
                except APIStatusError as err:
                    status = err.status_code
                    detail = well_formed(err.response.content[:200].decode("utf-8", "replace"))
                    if 300 <= status < 400:
                        raise BackendError(f"{url} answered HTTP {status} (a redirect to "
                                           f"{err.response.headers.get('location', '?')!r}); redirects are not "
                                           "followed, set base_url to the final address") from None
                    if status not in self.RETRYABLE_STATUS:
                        raise BackendError(f"{url} answered HTTP {status}: {detail}") from None
                    failure = f"HTTP {status}: {detail}"
                    asked = _retry_after(err.response.headers)
                    if asked is not None:
                        if time.monotonic() + asked > deadline:
                            raise BackendError(f"{url} answered HTTP {status} and asked to retry after {asked:g} s, "
                                               f"past the {self.deadline_s:g} s deadline of this call") from None
                        wait = asked
                except APITimeoutError:
                    failure = f"timed out (operation limit {self.timeout_s:g} s, deadline {self.deadline_s:g} s)"
                except APIConnectionError as err:
                    cause = err.__cause__ or err
                    failure = f"connection failed ({type(cause).__name__}: {str(cause)[:120]})"
                except _MalformedReply as err:
                    failure = str(err)
                if attempt == self.max_retries:
                    break
                if time.monotonic() + wait >= deadline:
                    failure += f"; no time left for another attempt within the {self.deadline_s:g} s deadline"
                    break
                time.sleep(wait)
        finally:
            self._deadline.set(None)
        attempts = f"{attempt + 1} attempt" + ("s" if attempt else "")
        raise BackendError(f"{url} failed after {attempts}; last error: {failure}")

    @staticmethod
    def _parse(body: bytes) -> dict[str, Any]:
        try:
            reply = json.loads(body.decode("utf-8"))
        except UnicodeDecodeError:
            raise _MalformedReply(f"reply is not UTF-8: {body[:60]!r}") from None
        except (ValueError, RecursionError):
            raise _MalformedReply(f"malformed JSON reply: {body[:80]!r}") from None
        if not isinstance(reply, dict):
            raise _MalformedReply(f"malformed reply: expected a JSON object, got {type(reply).__name__}")
        return reply


class _MalformedReply(Exception):
    """A reply that is not a UTF-8 JSON object (retried, then reported)."""


class OpenAIChatBackend(ChatBackend):
    """Chat completions from an OpenAI-compatible server.

    Args:
        base_url: server URL including the API prefix, e.g. ``http://localhost:8000/v1``.
        model: model name the server knows.
        temperature: sampling temperature (part of the cache key).
        max_tokens: reply budget.
        api_key, api_key_env, timeout_s, max_retries, backoff_s, deadline_s, max_reply_bytes: see
            :class:`OpenAICompatibleClient`.
    """

    def __init__(self, base_url: str, model: str, temperature: float = 0.0, max_tokens: int = 512,
                 api_key: str = "", api_key_env: str = "OPENAI_API_KEY", timeout_s: float = 30.0,
                 max_retries: int = 3, backoff_s: float = 0.5, deadline_s: float | None = None,
                 max_reply_bytes: int = 64 << 20) -> None:
        self.client = OpenAICompatibleClient(base_url, api_key, api_key_env, timeout_s, max_retries, backoff_s,
                                             deadline_s, max_reply_bytes)
        self.model, self.temperature, self.max_tokens = model, temperature, max_tokens

    def identity(self) -> dict[str, Any]:
        return {"kind": "openai-chat", "base_url": self.client.base_url, "model": self.model,
                "temperature": self.temperature, "max_tokens": self.max_tokens}

    def chat(self, messages: list[Message]) -> str:
        sent = [{"role": well_formed(str(m["role"])), "content": well_formed(str(m["content"]))} for m in messages]
        reply = self.client.post("/chat/completions", {
            "model": self.model, "messages": sent, "temperature": self.temperature, "max_tokens": self.max_tokens,
        })
        try:
            content = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError) as err:
            raise BackendError(f"{self.client.base_url}: malformed chat reply, no choices[0].message.content: "
                               f"{json.dumps(reply)[:120]}") from err
        if not isinstance(content, str):
            raise BackendError(f"{self.client.base_url}: malformed chat reply, content is {type(content).__name__}")
        return well_formed(content)


class OpenAIEmbeddingBackend(EmbeddingBackend):
    """Embeddings from an OpenAI-compatible server (HYDRA: ``text-embedding-3-small``, 1536-d).

    Args:
        base_url: server URL including the API prefix.
        model: embedding model name.
        dim: expected vector size (checked on every reply).
        api_key, api_key_env, timeout_s, max_retries, backoff_s, deadline_s, max_reply_bytes: see
            :class:`OpenAICompatibleClient`.
    """

    def __init__(self, base_url: str, model: str = "text-embedding-3-small", dim: int = 1536, api_key: str = "",
                 api_key_env: str = "OPENAI_API_KEY", timeout_s: float = 30.0, max_retries: int = 3,
                 backoff_s: float = 0.5, deadline_s: float | None = None, max_reply_bytes: int = 64 << 20) -> None:
        self.client = OpenAICompatibleClient(base_url, api_key, api_key_env, timeout_s, max_retries, backoff_s,
                                             deadline_s, max_reply_bytes)
        self.model, self.dim = model, dim

    def identity(self) -> dict[str, Any]:
        return {"kind": "openai-embedding", "base_url": self.client.base_url, "model": self.model, "dim": self.dim}

    def embed(self, texts: list[str]) -> np.ndarray:
        reply = self.client.post("/embeddings", {"model": self.model, "input": [well_formed(t) for t in texts],
                                                 "encoding_format": "float"})
        try:
            rows = sorted(reply["data"], key=lambda row: row["index"])
            vectors = np.asarray([row["embedding"] for row in rows], dtype=np.float32)
        except (KeyError, TypeError, ValueError) as err:
            raise BackendError(f"{self.client.base_url}: malformed embedding reply: "
                               f"{json.dumps(reply, default=str)[:120]}") from err
        if not np.isfinite(vectors).all():
            raise BackendError(f"{self.client.base_url}: the embedding reply holds non-finite numbers (NaN or inf)")
        if vectors.shape != (len(texts), self.dim):
            raise BackendError(f"{self.client.base_url}: expected {len(texts)} embeddings of size {self.dim}, "
                               f"got shape {vectors.shape}")
        return vectors


# ------------------------------------------------------------------------------------------------ local
class TransformersChatBackend(ChatBackend):
    """Greedy chat replies from a local causal LM directory (with its tokenizer's chat template if it has one).

    Args:
        model_path: Hugging Face model directory or hub id (e.g. a ``clova-train export --merged`` output).
        max_new_tokens: reply budget.
        device: torch device string.
    """

    def __init__(self, model_path: str, max_new_tokens: int = 256, device: str = "cpu") -> None:
        self.model_path, self.max_new_tokens, self.device = model_path, max_new_tokens, device
        self._model = self._tokenizer = None

    def identity(self) -> dict[str, Any]:
        return {"kind": "transformers-chat", "model": self.model_path, "max_new_tokens": self.max_new_tokens}

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            self._model = AutoModelForCausalLM.from_pretrained(self.model_path).to(self.device).eval()
        except (OSError, ValueError) as err:
            raise BackendError(f"cannot load chat model {self.model_path!r}: {err}") from err

    def chat(self, messages: list[Message]) -> str:
        import torch

        if self._model is None:
            self._load()
        tokenizer = self._tokenizer
        messages = [{"role": m["role"], "content": well_formed(m["content"])} for m in messages]
        if getattr(tokenizer, "chat_template", None):
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            prompt = "\n".join(f"{m['role'].upper()}: {m['content']}" for m in messages) + "\nASSISTANT:"
        inputs = tokenizer(prompt, return_tensors="pt").to(self.device)
        with torch.no_grad():
            output = self._model.generate(**inputs, max_new_tokens=self.max_new_tokens, do_sample=False,
                                          pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


class TransformersEmbeddingBackend(EmbeddingBackend):
    """Mean-pooled, L2-normalised last hidden states of a local Hugging Face encoder or decoder.

    Args:
        model_path: model directory or hub id.
        device: torch device string.
    """

    def __init__(self, model_path: str, device: str = "cpu") -> None:
        from transformers import AutoConfig

        self.model_path, self.device = model_path, device
        try:
            self.dim = int(AutoConfig.from_pretrained(model_path).hidden_size)
        except (OSError, ValueError) as err:
            raise BackendError(f"cannot load embedding model {model_path!r}: {err}") from err
        self._model = self._tokenizer = None

    def identity(self) -> dict[str, Any]:
        return {"kind": "transformers-embedding", "model": self.model_path}

    def embed(self, texts: list[str]) -> np.ndarray:
        import torch
        from transformers import AutoModel, AutoTokenizer

        if self._model is None:
            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            if self._tokenizer.pad_token is None:
                self._tokenizer.pad_token = self._tokenizer.eos_token
            self._model = AutoModel.from_pretrained(self.model_path).to(self.device).eval()
        batch = self._tokenizer([well_formed(t) for t in texts], return_tensors="pt", padding=True,
                                truncation=True).to(self.device)
        with torch.no_grad():
            hidden = self._model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        return torch.nn.functional.normalize(pooled, dim=-1).float().cpu().numpy()


# ------------------------------------------------------------------------------------------------ offline
class HashingEmbedder(EmbeddingBackend):
    """Signed feature hashing of lower-cased word unigrams and bigrams, L2-normalised.

    Deterministic across processes and machines (CRC32, not Python's salted ``hash``). A bag of words keeps
    which words a text uses, not their meaning; enough for the offline world, where what makes an
    instruction good or bad shows in its wording.

    Args:
        dim: vector size.
    """

    def __init__(self, dim: int = 64) -> None:
        self.dim = dim

    def identity(self) -> dict[str, Any]:
        return {"kind": "hashing", "dim": self.dim}

    def embed(self, texts: list[str]) -> np.ndarray:
        return hashing_embedding(texts, self.dim)
