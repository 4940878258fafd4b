"""Web search tools over HTTP (AVIS's ``image_search`` and ``text_search``), recorded and replayed by the call cache.

Protocol (one simple one, documented for a real search service or a proxy in front of one): a search is

    GET <url>?q=<query, URL-encoded>        (``Authorization: Bearer <key>`` when ``api_key_env`` is set)

and the reply is a JSON object ``{"results": ["text", ...]}`` (HTTP 200, UTF-8). The tool's answer is the first
result, or ``no results`` when the list is empty. :mod:`clova_train.llm.knowledge_server` serves a local JSON
knowledge file over this protocol, offline.

:class:`HttpSearchBackend` sends one search with the rules of the OpenAI backend
(:class:`~clova_train.llm.backends.OpenAICompatibleClient`): a limit per network operation and a total deadline per
call (slow, drip-fed replies included), retries of connection errors, timeouts, 408/429/5xx (``Retry-After``
honoured), no redirects (the key never goes to another origin), a bounded reply size (counted after any gzip or
deflate decompression; other encodings refused), and every failure (a 4xx,
HTML, a huge body, a JSON value of the wrong shape, text that is not UTF-8) one :class:`BackendError` naming the URL.

:class:`CachedSearch` keys each search by the backend's identity (its URLs) and ``{"tool", "query"}`` in the same
:class:`~clova_train.llm.cache.CallCache` as the LLM calls: ``record`` stores it, ``replay`` answers with zero HTTP
calls (a miss is :class:`~clova_train.llm.cache.ReplayMiss`). Failed searches are never stored.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx2

from clova_train.core.checks import Problems, is_integer
from clova_train.core.errors import ClovaTrainError
from clova_train.core.safe_files import ReadLimits, parse_json
from clova_train.llm.backends import BackendError, _Deadline, _retry_after, _transport, well_formed
from clova_train.llm.cache import CallCache

SEARCH_KINDS = ("image_search", "text_search")
NO_RESULTS = "no results"
MAX_QUERY_CHARS = 1000
MAX_RESULT_CHARS = 2000
MAX_REPLY_BYTES = 1 << 20
REPLY_LIMITS = ReadLimits(max_bytes=MAX_REPLY_BYTES, max_depth=20)


class SearchBackend(Protocol):
    """Answers a web search of one kind (``image_search``: a description of an image crop; ``text_search``: text)."""

    def identity(self) -> dict[str, Any]:
        """What answers the searches (kind, URLs; never the key): part of every cache key."""

    def search(self, kind: str, query: str) -> str:
        """The answer: the first result, or ``no results``; a failure is a :class:`BackendError`."""


class _BadReply(Exception):
    """A reply that breaks the protocol (not retried: the server would send it again)."""


class _Retryable(Exception):
    """A failed attempt worth another (connection error, timeout, 408/429/5xx); ``wait``: the server's Retry-After."""

    def __init__(self, message: str, wait: float | None = None) -> None:
        super().__init__(message)
        self.wait = wait


class HttpSearchBackend:
    """Searches over HTTP with the protocol of the module docstring.

    Args:
        image_search_url: endpoint of ``image_search`` (none: that kind is not served here).
        text_search_url: endpoint of ``text_search`` (none: not served here).
        api_key_env: environment variable holding the key sent as ``Authorization: Bearer``; empty or unset: none.
        timeout_s: limit of each network operation (connect, each read, each write).
        max_retries: retries after the first attempt (connection errors, timeouts, 408/429/5xx).
        backoff_s: first retry delay when the server gives none; doubled for each further retry.
        deadline_s: total time of one search, retries included (default: ``timeout_s * (max_retries + 1)``).
        max_reply_bytes: largest reply body read.
    """

    RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})

    def __init__(self, image_search_url: str | None = None, text_search_url: str | None = None,
                 api_key_env: str = "", timeout_s: float = 10.0, max_retries: int = 2, backoff_s: float = 0.25,
                 deadline_s: float | None = None, max_reply_bytes: int = MAX_REPLY_BYTES) -> None:
        self.urls = {"image_search": image_search_url, "text_search": text_search_url}
        self.api_key_env = api_key_env
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s
        self.deadline_s = deadline_s if deadline_s is not None else timeout_s * (max_retries + 1)
        self.max_reply_bytes = max_reply_bytes
        self.requests = 0  # HTTP requests sent (attempts), for tests and benchmarks
        self._deadline = _Deadline(max_reply_bytes + (1 << 20))  # body + headers; the body is bounded below
        self._client: httpx2.Client | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None, "_deadline": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._deadline = _Deadline(self.max_reply_bytes + (1 << 20))

    def identity(self) -> dict[str, Any]:
        return {"kind": "http-search", **{f"{k}_url": v for k, v in self.urls.items() if v}}

    @property
    def client(self) -> httpx2.Client:
        if self._client is None:
            self._client = httpx2.Client(transport=_transport(self._deadline), follow_redirects=False,
                                         trust_env=False, timeout=self.timeout_s)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def search(self, kind: str, query: str) -> str:
        url = self.urls.get(kind)
        if not url:
            raise BackendError(f"no URL is configured for {kind} (one of {', '.join(SEARCH_KINDS)})")
        query = well_formed(str(query))[:MAX_QUERY_CHARS]
        headers = {"Accept": "application/json", "Accept-Encoding": "identity"}
        key = os.environ.get(self.api_key_env, "") if self.api_key_env else ""
        if key:
            headers["Authorization"] = f"Bearer {key}"
        deadline = time.monotonic() + self.deadline_s
        failure, attempt = "", 0
        try:
            for attempt in range(self.max_retries + 1):
                wait = self.backoff_s * 2**attempt
                self._deadline.set(deadline)
                try:
                    return self._attempt(url, query, headers)
                except _BadReply as err:
                    raise BackendError(f"{kind} at {url}: {err}") from None
                except _Retryable as err:
                    failure = str(err)
                    if err.wait is not None:
                        if time.monotonic() + err.wait > deadline:
                            raise BackendError(f"{kind} at {url}: {failure} and asked to retry after "
                                               f"{err.wait:g} s, past the {self.deadline_s:g} s deadline") from None
                        wait = err.wait
                if attempt == self.max_retries:
                    break
                if time.monotonic() + wait >= deadline:
                    failure += f"; no time left for another attempt within the {self.deadline_s:g} s deadline"
                    break
                time.sleep(wait)
        finally:
            self._deadline.set(None)
        attempts = f"{attempt + 1} attempt" + ("s" if attempt else "")
        raise BackendError(f"{kind} at {url} failed after {attempts}; last error: {failure}")

    def _attempt(self, url: str, query: str, headers: dict[str, str]) -> str:
        self.requests += 1
        try:
            with self.client.stream("GET", url, params={"q": query}, headers=headers) as response:
                status = response.status_code
                if 300 <= status < 400:
                    raise _BadReply(f"answered HTTP {status} (a redirect to "
                                    f"{response.headers.get('location', '?')[:200]!r}); redirects are not followed, "
                                    "set the URL to the final address")
                body = self._read(response)
        except httpx2.TimeoutException:
            raise _Retryable(f"timed out (operation limit {self.timeout_s:g} s, deadline {self.deadline_s:g} s)") \
                from None
        except httpx2.HTTPError as err:
            raise _Retryable(f"connection failed ({type(err).__name__}: {str(err)[:120]})") from None
        if status != 200:
            detail = well_formed(body[:200].decode("utf-8", "replace"))
            if status in self.RETRYABLE_STATUS:
                raise _Retryable(f"HTTP {status}: {detail}", _retry_after(response.headers))
            raise _BadReply(f"answered HTTP {status}: {detail}")
        return self._parse(body)

    def _read(self, response: httpx2.Response) -> bytes:
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_reply_bytes:
            raise _BadReply(f"the reply is {int(declared):,} bytes, more than the {self.max_reply_bytes:,} accepted")
        chunks, size = [], 0
        for chunk in response.iter_bytes():
            size += len(chunk)
            if size > self.max_reply_bytes:
                raise _BadReply(f"the reply is larger than the {self.max_reply_bytes:,} bytes accepted")
            chunks.append(chunk)
        return b"".join(chunks)

    @staticmethod
    def _parse(body: bytes) -> str:
        try:
            reply = parse_json(body, "the reply", REPLY_LIMITS, finite_only=True)
        except ClovaTrainError as err:
            raise _BadReply(f"malformed search reply ({err}); it starts {body[:60]!r}") from None
        results = reply.get("results") if isinstance(reply, dict) else None
        if not isinstance(results, list) or not all(isinstance(r, str) for r in results):
            raise _BadReply('malformed search reply: expected a JSON object {"results": ["text", ...]}, got '
                            f"{body[:80]!r}")
        first = " ".join(well_formed(results[0]).split()) if results else ""
        return first[:MAX_RESULT_CHARS] or NO_RESULTS


class CachedSearch:
    """A search backend whose calls go through a :class:`CallCache` (the LLM calls' cache; see the module docstring)."""

    def __init__(self, backend: SearchBackend, cache: CallCache) -> None:
        self.backend, self.cache = backend, cache

    def identity(self) -> dict[str, Any]:
        return self.backend.identity()

    def search(self, kind: str, query: str) -> str:
        if self.cache.mode == "off":
            self.cache.stats.backend_calls += 1
            return self.backend.search(kind, query)
        key, text, stored = self.cache.lookup(self.identity(), {"tool": kind, "query": query})
        if stored is not None:
            return stored.decode("utf-8", "surrogatepass")
        self.cache.stats.backend_calls += 1
        answer = self.backend.search(kind, query)
        self.cache.put(key, text, answer.encode("utf-8", "surrogatepass"))
        return answer


def _url_ok(url: Any) -> bool:
    if url is None:
        return True
    if not isinstance(url, str):
        return False
    parts = urlsplit(url)
    return parts.scheme in ("http", "https") and bool(parts.netloc) and not parts.fragment


@dataclass
class WebSearchConfig:
    """The ``web`` section of the AVIS environment: where ``image_search`` and ``text_search`` go.

    Args:
        image_search_url: HTTP endpoint of ``image_search`` (``GET <url>?q=<query>`` -> ``{"results": [...]}``);
            null: the offline world's knowledge base.
        text_search_url: the same for ``text_search``.
        api_key_env: environment variable holding the key sent as ``Authorization: Bearer`` (empty: none).
        timeout_s: limit of each network operation of a search.
        max_retries: retries on connection errors, timeouts, 408/429/5xx.
    """

    image_search_url: str | None = None
    text_search_url: str | None = None
    api_key_env: str = ""
    timeout_s: float = 10.0
    max_retries: int = 2

    def tools(self) -> tuple[str, ...]:
        """The search tools that go over HTTP."""
        return tuple(k for k in SEARCH_KINDS if getattr(self, f"{k}_url"))

    def build(self) -> HttpSearchBackend | None:
        """The HTTP backend, or none when both URLs are null (the offline knowledge base answers)."""
        if not self.tools():
            return None
        return HttpSearchBackend(self.image_search_url or None, self.text_search_url or None, self.api_key_env,
                                 self.timeout_s, self.max_retries)

    def problems(self, prefix: str = "web") -> list[str]:
        """Every bad value, as ``<prefix>.<field> = <value>: <rule>``."""
        found = Problems(prefix)
        for kind in SEARCH_KINDS:
            name = f"{kind}_url"
            found.need(_url_ok(getattr(self, name)), name, getattr(self, name),
                       "must be an http:// or https:// URL with a host (or null: the offline knowledge base)")
        found.need(isinstance(self.api_key_env, str), "api_key_env", self.api_key_env, "must be a string")
        found.positive("timeout_s", self.timeout_s)
        found.need(is_integer(self.max_retries) and self.max_retries >= 0, "max_retries", self.max_retries,
                   "must be an integer >= 0")
        return found.messages


__all__ = ["CachedSearch", "HttpSearchBackend", "NO_RESULTS", "SEARCH_KINDS", "SearchBackend", "WebSearchConfig"]
