"""Stopping a server as services are stopped: SIGTERM (systemd, Docker, Kubernetes) or SIGINT (Ctrl-C) ends it with
its worker processes within a bounded time, and a second signal forces the stop.

LitServe shuts its API server and inference workers down gracefully on ``KeyboardInterrupt`` only; a SIGTERM killed
the parent alone and left its workers answering on the port. :func:`stop_on_signals` turns the first signal into
that ``KeyboardInterrupt`` (graceful: the API server stops taking connections and finishes or drops what is in flight
within its grace period), and :func:`stop_children` then ends whatever child process is left, whenever the signal
came (a server still loading its models has no graceful path of its own).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def stop_children(grace_seconds: float = 10.0) -> None:
    """Terminate every child process this process started (SIGTERM), wait up to ``grace_seconds`` for them all,
    then kill those still alive."""
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(timeout=grace_seconds / max(len(children), 1))
    for child in children:
        if child.is_alive():
            child.kill()
            child.join(timeout=5)


@contextmanager
def stop_on_signals() -> Iterator[list[int]]:
    """Within the block, SIGTERM and SIGINT raise ``KeyboardInterrupt`` in the main thread (the block's graceful
    stop); a second one kills the children and exits at once with 128 + its number. Yields the signals received."""
    received: list[int] = []

    def handle(signum: int, frame: object) -> None:
        received.append(signum)
        if len(received) > 1:
            for child in multiprocessing.active_children():
                child.kill()
            os._exit(128 + signum)
        raise KeyboardInterrupt

    previous = {number: signal.signal(number, handle) for number in STOP_SIGNALS}
    try:
        yield received
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
