"""The call cache under concurrent first opens, and with text that is not valid Unicode."""

from __future__ import annotations

import multiprocessing
import sqlite3
from pathlib import Path

import pytest

from clova_train.llm.backends import BackendError, ChatBackend
from clova_train.llm.cache import CachedChat, CallCache

PROCESSES, ROUNDS, ENTRIES = 4, 20, 5


def _open_and_write(path: str, worker: int, barrier, errors) -> None:
    try:
        barrier.wait(timeout=30)
        cache = CallCache(path)
        for i in range(ENTRIES):
            key, text = CallCache.key({"kind": "test"}, f"worker {worker} entry {i}")
            cache.put(key, text, f"reply {worker}.{i}".encode())
    except Exception as err:  # noqa: BLE001 (reported to the parent)
        errors.put(f"worker {worker}: {type(err).__name__}: {err}")


def test_processes_opening_a_fresh_cache_at_once_never_fail(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")
    errors = context.Queue()
    for round_ in range(ROUNDS):
        path = str(tmp_path / f"round{round_}" / "cache.sqlite")
        barrier = context.Barrier(PROCESSES)
        workers = [context.Process(target=_open_and_write, args=(path, w, barrier, errors)) for w in range(PROCESSES)]
        for process in workers:
            process.start()
        for process in workers:
            process.join(timeout=60)
            assert process.exitcode == 0
        assert errors.empty(), errors.get()
        cache = CallCache(path, mode="replay")
        assert len(cache) == PROCESSES * ENTRIES  # nothing lost
        for w in range(PROCESSES):
            key, _ = CallCache.key({"kind": "test"}, f"worker {w} entry {ENTRIES - 1}")
            assert cache.get(key) == f"reply {w}.{ENTRIES - 1}".encode()
        assert cache.connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert sorted(p.name for p in Path(path).parent.iterdir() if not p.name.startswith("cache.sqlite")) == []


class Echo(ChatBackend):
    def __init__(self) -> None:
        self.calls = 0

    def identity(self) -> dict:
        return {"kind": "echo"}

    def chat(self, messages: list[dict]) -> str:
        self.calls += 1
        return "reply with \udc80 and \ud800 to " + messages[-1]["content"]


def test_lone_surrogates_are_stored_and_replayed_exactly(tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "memory: \udcff broken output"}]
    backend = Echo()
    recorded = CachedChat(backend, CallCache(tmp_path / "c.sqlite")).chat(messages)
    replayed = CachedChat(Echo(), CallCache(tmp_path / "c.sqlite", mode="replay")).chat(messages)
    assert replayed == recorded == "reply with \udc80 and \ud800 to memory: \udcff broken output"
    other = [{"role": "user", "content": "memory: \udcfe broken output"}]  # another surrogate: another key
    with pytest.raises(BackendError, match="replay mode"):
        CachedChat(Echo(), CallCache(tmp_path / "c.sqlite", mode="replay")).chat(other)


def test_keys_of_valid_text_are_unchanged() -> None:
    """Caches recorded before surrogate support still replay: valid text hashes as it always did."""
    import hashlib
    import json

    request = [{"role": "user", "content": "héllo"}]
    text = json.dumps({"backend": {"kind": "x"}, "request": request}, sort_keys=True, ensure_ascii=False)
    assert CallCache.key({"kind": "x"}, request)[0] == hashlib.sha256(text.encode()).hexdigest()


def test_a_corrupt_cache_file_is_one_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.sqlite"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(BackendError, match=f"call cache {path} cannot be opened"):
        len(CallCache(path))


def test_an_old_rollback_journal_cache_is_switched_to_wal(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    old = sqlite3.connect(path)
    old.execute("CREATE TABLE calls (key TEXT PRIMARY KEY, request TEXT NOT NULL, reply BLOB NOT NULL)")
    old.execute("INSERT INTO calls VALUES ('k', 'r', x'01')")
    old.commit()
    old.close()
    cache = CallCache(path)
    assert cache.get("k") == b"\x01"
    assert cache.connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
