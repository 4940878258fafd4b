"""``clova-train serve`` in a child process on a free loopback port, for the HTTP tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from contextlib import contextmanager, suppress

import pytest

from helpers.common import REPO


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args: list[str], env: dict[str, str] | None = None, cwd: Path = REPO,
                 port: int | None = None) -> tuple[str, subprocess.Popen]:
    """``clova-train serve ARGS`` on 127.0.0.1 in its own process group: (base URL, process) once /health answers."""
    port = port or free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "clova_train", "serve", *args, "--port", str(port)],
        cwd=cwd, env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        if process.poll() is not None:
            pytest.fail(f"the server exited: {process.stdout.read()[-3000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as response:
                if response.status == 200:
                    return base, process
        except OSError:
            pass
        if time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            pytest.fail("the server did not come up within 180 s")
        time.sleep(0.5)


def process_group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":  # state, ppid, pgrp: zombies are already gone
                found.append(int(entry.name))
    return found


@contextmanager
def serving(args: list[str], env: dict[str, str] | None = None,
            cwd: Path = REPO) -> Iterator[tuple[str, subprocess.Popen]]:
    """:func:`start_server`, stopped on exit (SIGTERM to the group, then SIGKILL)."""
    base, process = start_server(args, env, cwd)
    try:
        yield base, process
    finally:
        stop_server(process)


def stop_server(process: subprocess.Popen, timeout_s: float = 20) -> None:
    """SIGTERM to the server's process group (SIGKILL after ``timeout_s``), then wait until none of it is left. A test
    may have stopped it already. Graceful first: SIGKILL leaves its multiprocessing semaphores in /dev/shm."""
    with suppress(ProcessLookupError):  # the group is gone already
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while process_group(process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
