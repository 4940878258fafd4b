"""Run one hostile case as the user would (``clova-train <argv>``) in a child process under a wall-time, CPU-time and
address-space limit, cheaply: the child is forked from one forkserver per pytest worker that has imported the CLI
(and through it torch) but never ran a torch operation, so a case costs a fork, not a fresh interpreter.

A hang, an abort (Rust panic, ``SIGABRT``) or a memory exhaustion in the case ends that child only, and the test
sees it as :class:`CaseOutcome` (``killed`` says why) instead of losing its worker."""

from __future__ import annotations

import math
import multiprocessing
import multiprocessing.connection
import os
import resource
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Sequence

# What the cases' commands import lazily, imported once in the forkserver rather than in every case: torch and the CLI
# (report, controller), and ``export``/``serve``'s Lightning, transformers and the HTTP server (about 5 s once, a
# case then costs about a second instead of 6). The forkserver is one per process, shared with every other user of
# the "forkserver" start method (SB3's ``SubprocVecEnv`` defaults to it), and the preload only counts if it is set
# before the first of them starts it: ``tests/conftest.py`` imports this module for that. A child that finds the
# modules missing all the same imports them before its case starts (seconds, outside the case's limits).
PRELOAD = ["torch", "clova_train.cli", "clova_train.report.figures", "clova_train.sb3.files",
           "clova_train.controller.trainer", "clova_train.export.lora", "clova_train.serving.http",
           "clova_train.tooluse.served_llm"]
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)


@dataclass(frozen=True)
class CaseOutcome:
    """What a user would see of one contained CLI run."""

    exit_code: int | None  # None: killed by a signal
    killed: str | None  # "timeout", "memory", "signal N" or None when the case ended by itself
    stdout: str
    stderr: str
    seconds: float = 0.0  # wall time from the case's start (the child running, limits set) to its end

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if "error" in line.lower()]

    @property
    def error_message(self) -> str:
        """The first error line with the indented lines that continue it (``invalid controller config:`` names the
        field on the next line)."""
        lines = self.stderr.splitlines()
        start = next((i for i, line in enumerate(lines) if "error" in line.lower()), len(lines))
        end = start + 1
        while end < len(lines) and lines[end][:1].isspace():
            end += 1
        return "\n".join(lines[start:end])


def _child(argv: list[str], out_path: str, err_path: str, memory_mb: int, cpu_s: int,
           entry: Callable[[list[str]], int | None] | None, started: multiprocessing.connection.Connection) -> None:
    """The forked case: its stdout/stderr into the files, the preloaded imports, the limits, then it tells the parent
    it started (the wall-clock limit counts from there), then ``entry(argv)`` (the CLI's own ``main`` unless
    given)."""
    out_fd = os.open(out_path, os.O_WRONLY)
    err_fd = os.open(err_path, os.O_WRONLY)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)  # from here an import's traceback lands where the test reads it
    os.environ["OMP_NUM_THREADS"] = "1"
    for name in PRELOAD:  # imported already unless the forkserver was started without PRELOAD (see above)
        __import__(name)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    spent = math.ceil(usage.ru_utime + usage.ru_stime)  # RLIMIT_CPU counts the whole process, starting included
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_CPU, (spent + cpu_s, spent + cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # an abort leaves no core file behind
    try:
        import torch

        torch.set_num_threads(1)
        from clova_train.cli import main

        started.send_bytes(b"started")
        started.close()
        code = (entry or main)(argv)
    except SystemExit as exit_:  # argparse's --help and usage errors end this way, as they do for the user
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except MemoryError:
        sys.stderr.write("contained: MemoryError\n")
        code = 99
    except BaseException:  # the traceback goes to the captured stderr, where the test looks for it
        import traceback

        traceback.print_exc()
        code = 98
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 0)


# How long a case may take to start (the forkserver's preload when it is cold or was restarted, the fork, unpickling
# the case's entry and the modules it names) before it counts as never started. Not part of the case's own limit.
STARTUP_LIMIT_S = 300.0


def _wait_for_start(process: multiprocessing.process.BaseProcess,
                    started: multiprocessing.connection.Connection) -> str | None:
    """Wait, untimed by the case's own limit, until the child says it started; the reason when it never does."""
    ready = multiprocessing.connection.wait([started, process.sentinel], timeout=STARTUP_LIMIT_S)
    if started in ready:
        try:
            started.recv_bytes()
            return None
        except EOFError:  # the child ended before its case began
            pass
    if not ready:
        process.kill()
        return "startup timeout"
    process.join()
    return f"died before starting (exit code {process.exitcode})"


def run_cli(argv: Sequence[str], *, timeout_s: float = 20.0, memory_mb: int = 6144, cpu_s: int = 20,
            entry: Callable[[list[str]], int | None] | None = None) -> CaseOutcome:
    """Run ``clova-train argv`` in a forked child under the limits and report what the user would see.

    Args:
        argv: the CLI arguments (without the program name).
        timeout_s: wall-clock limit from the case's start (its child forked, limits set); past it the child is killed
            and ``killed`` is ``"timeout"``. Starting (a cold forkserver's preload, the fork) is not counted: under a
            loaded machine it takes seconds, and a case killed before it began would report a hang it never had.
        memory_mb: the child's address-space limit (``RLIMIT_AS``); the preloaded CLI and torch map ~3.3 GB of address space.
        cpu_s: the child's CPU-time limit (``RLIMIT_CPU``, ``SIGXCPU`` past it).
        entry: a module-level function run instead of the CLI's ``main`` (it gets ``argv``, returns the exit code).
    """
    with tempfile.NamedTemporaryFile("w+") as out, tempfile.NamedTemporaryFile("w+") as err:
        started, started_in_child = _CONTEXT.Pipe(duplex=False)
        process = _CONTEXT.Process(target=_child, args=(list(argv), out.name, err.name, memory_mb, cpu_s, entry,
                                                        started_in_child))
        process.start()
        started_in_child.close()
        killed = _wait_for_start(process, started)
        started.close()
        began = time.monotonic()
        if killed is None:
            process.join(timeout_s)
            if process.is_alive():
                process.kill()
                killed = "timeout"
        process.join()
        seconds = time.monotonic() - began
        code = process.exitcode
        if killed is None and code is not None and code < 0:
            killed = "timeout" if -code == signal.SIGXCPU else f"signal {-code}"
        if code == 99:
            killed = "memory"
        return CaseOutcome(None if code is None or code < 0 else code, killed, open(out.name).read(),
                           open(err.name).read(), seconds)


def assert_one_clean_error(outcome: CaseOutcome, *words: str) -> None:
    """The case finished within its limits, exited 1 or 2, with one error message holding ``words`` (its line, or the
    indented lines continuing it) and no traceback."""
    assert outcome.killed is None, (outcome.killed, outcome.stderr[-2000:])
    assert outcome.exit_code in (1, 2), (outcome.exit_code, outcome.stderr[-2000:])
    assert "Traceback" not in outcome.stderr, outcome.stderr[-2000:]
    lines = outcome.error_lines
    assert len(lines) == 1, outcome.stderr[-2000:]
    message = outcome.error_message
    assert all(word in message for word in words), message
