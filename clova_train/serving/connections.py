"""The HTTP server's connections, bounded: how many it holds, and how long a client may take to send a request.

LitServe runs uvicorn, which by itself keeps a connection that sent half a request's headers open for as long as
the client likes: 1,100 such connections take every descriptor of a 1,024 limit and no good request is answered.
:func:`bounded_protocol` gives uvicorn (its ``http=`` setting) an HTTP/1.1 protocol (uvicorn's h11 one) with

* a **connection cap** (:attr:`ConnectionLimits.max_connections`, kept below the open-file limit by
  :func:`usable_connection_cap`): a new connection beyond it closes the connection that has waited longest for a
  request's headers (a slow or idle client); when every held connection is busy with a request, the new one is
  closed instead. A good client that sends its request at once is therefore answered whatever number of slow ones
  are trying to hold connections;
* a **header deadline**: a request's headers must be complete ``header_timeout_s`` after the connection opened (or
  after the previous response on a kept-alive connection), however slowly they trickle in; else it is closed;
* a **body deadline**: its body must be complete ``body_timeout_s`` after its headers; else it is closed.

Once a request is read, the application's own limits apply (LitServe's ``timeout``). What a request's body may
hold, and how many bodies the server holds at once, is the request guard's part
(:class:`~clova_train.serving.guard.RequestGuard`, ``max_inflight_body_bytes``). :func:`raise_open_file_limit`
lifts the soft open-file limit to the hard one at start, where allowed. Pipelined and kept-alive requests each pass
the guard (API key included) as requests of their own.
"""

from __future__ import annotations

import asyncio
import resource
from dataclasses import dataclass
from typing import Any, Optional

from uvicorn.protocols.http.h11_impl import H11Protocol

RESERVED_DESCRIPTORS = 64  # files, pipes and sockets the server needs beside its client connections


@dataclass(frozen=True)
class ConnectionLimits:
    """Bounds on the server's client connections.

    Args:
        max_connections: most client connections held at once (lowered to what the open-file limit allows).
        header_timeout_s: seconds a request's headers may take, from the connection (or the previous response).
        body_timeout_s: seconds a request's body may take, from its headers.
    """

    max_connections: int = 4096
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("max_connections", "header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def raise_open_file_limit() -> int:
    """Lift the soft open-file limit to the hard one (where the system allows); the soft limit in force after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def usable_connection_cap(wanted: int, open_file_limit: int) -> int:
    """``wanted``, lowered so the connections leave :data:`RESERVED_DESCRIPTORS` of the open-file limit free."""
    return max(1, min(wanted, open_file_limit - RESERVED_DESCRIPTORS))


class ConnectionBook:
    """The connections one server process holds, and which of them wait for a request's headers (oldest first)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.held: set[Any] = set()
        self.waiting: dict[Any, None] = {}  # insertion order: longest waiting first

    def admit(self, connection: Any) -> bool:
        """Hold ``connection``, closing the longest-waiting one when full; ``False`` when every held one is busy."""
        if len(self.held) >= self.cap:
            if not self.waiting:
                return False
            oldest = next(iter(self.waiting))
            self.release(oldest)
            oldest.close_now()
        self.held.add(connection)
        return True

    def wait(self, connection: Any) -> None:
        self.waiting.pop(connection, None)
        self.waiting[connection] = None

    def busy(self, connection: Any) -> None:
        self.waiting.pop(connection, None)

    def release(self, connection: Any) -> None:
        self.held.discard(connection)
        self.waiting.pop(connection, None)


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the connection cap and the header and body deadlines (see the module docstring);
    :func:`bounded_protocol` makes one per server with its limits."""

    limits: ConnectionLimits = ConnectionLimits()
    book: Optional[ConnectionBook] = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: Optional[asyncio.TimerHandle] = None
        self._seen_cycle: Any = None
        book = self._book()
        if not book.admit(self):
            self.close_now()
            return
        self._await_headers()

    def handle_events(self) -> None:
        super().handle_events()
        cycle = self.cycle
        if cycle is None or getattr(self, "_deadline", None) is None and cycle is self._seen_cycle:
            return
        if cycle is not self._seen_cycle:  # a request's headers are complete
            self._seen_cycle = cycle
            self._book().busy(self)
            if cycle.more_body:
                self._arm(self.limits.body_timeout_s)
                return
            self._disarm()
        elif not cycle.more_body and not cycle.response_complete:  # its body is complete
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_headers()  # a kept-alive connection: the next request's headers have their deadline

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
        self._book().release(self)
        super().connection_lost(exc)

    def close_now(self) -> None:
        """Close this connection (a deadline passed, or the cap needs its place)."""
        self._disarm()
        if not self.transport.is_closing():
            self.transport.close()

    def _await_headers(self) -> None:
        if self.cycle is not None and not self.cycle.response_complete:  # a pipelined request already started
            return
        self._book().wait(self)
        self._arm(self.limits.header_timeout_s)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self.close_now)

    def _disarm(self) -> None:
        deadline = getattr(self, "_deadline", None)
        if deadline is not None:
            deadline.cancel()
            self._deadline = None

    @classmethod
    def _book(cls) -> ConnectionBook:
        if cls.book is None:
            cls.book = ConnectionBook(cls.limits.max_connections)
        return cls.book


def bounded_protocol(limits: ConnectionLimits, open_file_limit: Optional[int] = None) -> type[BoundedH11Protocol]:
    """A protocol class for uvicorn's ``http=`` with ``limits`` (its cap lowered to fit ``open_file_limit``, default:
    the soft limit now); each server process that forks from here keeps its own book of connections."""
    if open_file_limit is None:
        open_file_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    cap = usable_connection_cap(limits.max_connections, open_file_limit)
    fitted = ConnectionLimits(cap, limits.header_timeout_s, limits.body_timeout_s)
    return type("BoundedH11Protocol", (BoundedH11Protocol,), {"limits": fitted, "book": None})
