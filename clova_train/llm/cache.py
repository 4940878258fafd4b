"""A persistent SQLite cache of LLM and embedding calls, keyed by the full request.

The key is the SHA-256 of the canonical JSON of ``{"backend": backend.identity(), "request": ...}``: the
backend kind, model, URL and sampling parameters, and the whole message list (or the text to embed). A hit
replays the stored reply; a recorded run therefore replays with zero backend calls.

Modes: ``record`` (hits replay, misses call the backend and are stored), ``replay`` (a miss is an error
naming the request: for reproducing a run offline), ``off``. The database uses WAL journaling and a busy
timeout, so the environments of a ``SubprocVecEnv`` can share one file. Each process opens its own
connection lazily (connections are not pickled).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sqlite3
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from clova_train.llm.backends import BackendError, ChatBackend, EmbeddingBackend, Message

CacheMode = Literal["record", "replay", "off"]
SCHEMA = "CREATE TABLE IF NOT EXISTS calls (key TEXT PRIMARY KEY, request TEXT NOT NULL, reply BLOB NOT NULL)"
BUSY_TIMEOUT_S = 30.0


class ReplayMiss(BackendError):
    """A ``replay`` cache has no reply for a request: the run differs from the recorded one (a configuration
    error, never a backend failure that a caller may turn into an observation)."""


@dataclass
class CacheStats:
    """Counters of one process's lookups."""

    hits: int = 0
    misses: int = 0
    backend_calls: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class CallCache:
    """Key-value store of replies.

    Args:
        path: SQLite file (created with its parent directory).
        mode: ``record``, ``replay`` or ``off``.
    """

    def __init__(self, path: str | Path, mode: CacheMode = "record") -> None:
        self.path, self.mode = Path(path), mode
        self.stats = CacheStats()
        self._connection: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "mode": self.mode}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["mode"])

    def _create(self) -> None:
        """Create the database file whole (table and WAL mode) and move it into place, if it is not there yet.

        Switching a database to WAL takes an exclusive lock that SQLite does not wait for (the busy timeout does
        not apply), so processes opening a fresh cache at once used to fail with "database is locked". Here
        each builds a private file and links it into place; one wins, the others use the winner's file.
        """
        if self.path.exists():
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, scratch = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        os.close(fd)
        try:
            fresh = sqlite3.connect(scratch)
            fresh.execute("PRAGMA journal_mode=WAL")
            fresh.execute(SCHEMA)
            fresh.commit()
            fresh.close()
            os.chmod(scratch, 0o644)
            try:
                os.link(scratch, self.path)
            except FileExistsError:
                pass
        finally:
            for leftover in (scratch, f"{scratch}-wal", f"{scratch}-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(leftover)

    @property
    def connection(self) -> sqlite3.Connection:
        if self._connection is None:
            try:
                self._create()
                connection = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, check_same_thread=False)
                if connection.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                    self._enable_wal(connection)  # a cache written by an older version
                connection.execute(SCHEMA)
                connection.commit()
            except sqlite3.DatabaseError as err:
                raise BackendError(f"call cache {self.path} cannot be opened: {err}") from None
            self._connection = connection
        return self._connection

    @staticmethod
    def _enable_wal(connection: sqlite3.Connection) -> None:
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        while True:
            try:
                connection.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as err:
                if "locked" not in str(err) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    @staticmethod
    def key(backend: dict[str, Any], request: Any) -> tuple[str, str]:
        """``(sha256 key, stored request text)``. Text with lone surrogates hashes and stores exactly: the key is
        taken over the UTF-8 bytes with surrogates passed through, the stored text is ASCII-escaped JSON."""
        canonical = {"backend": backend, "request": request}
        text = json.dumps(canonical, sort_keys=True, ensure_ascii=False)
        key = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
        return key, json.dumps(canonical, sort_keys=True)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            row = self.connection.execute("SELECT reply FROM calls WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def put(self, key: str, request_text: str, reply: bytes) -> None:
        with self._lock:
            self.connection.execute("INSERT OR REPLACE INTO calls VALUES (?, ?, ?)", (key, request_text, reply))
            self.connection.commit()

    def __len__(self) -> int:
        return self.connection.execute("SELECT COUNT(*) FROM calls").fetchone()[0]

    def lookup(self, backend: dict[str, Any], request: Any) -> tuple[str, str, bytes | None]:
        """``(key, request_text, stored reply or None)``; counts hits and misses; raises on a replay miss."""
        key, text = self.key(backend, request)
        reply = self.get(key)
        if reply is not None:
            self.stats.hits += 1
        else:
            self.stats.misses += 1
            if self.mode == "replay":
                raise ReplayMiss(f"cache {self.path} (replay mode) has no reply for {backend.get('kind')} "
                                 f"request {text[:160]}...")
        return key, text, reply


class CachedChat(ChatBackend):
    """A chat backend whose calls go through a :class:`CallCache`."""

    def __init__(self, backend: ChatBackend, cache: CallCache) -> None:
        self.backend, self.cache = backend, cache

    def identity(self) -> dict[str, Any]:
        return self.backend.identity()

    def chat(self, messages: list[Message]) -> str:
        if self.cache.mode == "off":
            self.cache.stats.backend_calls += 1
            return self.backend.chat(messages)
        key, text, stored = self.cache.lookup(self.identity(), messages)
        if stored is not None:
            return stored.decode("utf-8", "surrogatepass")
        self.cache.stats.backend_calls += 1
        reply = self.backend.chat(messages)
        self.cache.put(key, text, reply.encode("utf-8", "surrogatepass"))
        return reply


class CachedEmbedding(EmbeddingBackend):
    """An embedding backend whose calls go through a :class:`CallCache` (one entry per text, float32 bytes)."""

    def __init__(self, backend: EmbeddingBackend, cache: CallCache) -> None:
        self.backend, self.cache, self.dim = backend, cache, backend.dim

    def identity(self) -> dict[str, Any]:
        return self.backend.identity()

    def embed(self, texts: list[str]) -> np.ndarray:
        if self.cache.mode == "off":
            self.cache.stats.backend_calls += 1
            return self.backend.embed(texts)
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        missing: list[tuple[int, str, str]] = []
        for i, text in enumerate(texts):
            key, request, stored = self.cache.lookup(self.identity(), text)
            if stored is None:
                missing.append((i, key, request))
            else:
                out[i] = np.frombuffer(stored, dtype=np.float32)
        if missing:
            self.cache.stats.backend_calls += 1
            vectors = self.backend.embed([texts[i] for i, _, _ in missing]).astype(np.float32)
            for (i, key, request), vector in zip(missing, vectors):
                out[i] = vector
                self.cache.put(key, request, vector.tobytes())
        return out
