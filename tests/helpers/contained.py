"""Run one hostile case as the user would (``clova-train <argv>``) in a child process under a wall-time, CPU-time and
address-space limit, cheaply: the child is forked from one forkserver per pytest worker that has imported the CLI
(and through it torch) but never ran a torch operation, so a case costs a fork, not a fresh interpreter.

A hang, an abort (Rust panic, ``SIGABRT``) or a memory exhaustion in the case ends that child only, and the test
sees it as :class:`CaseOutcome` (``killed`` says why) instead of losing its worker."""

from __future__ import annotations

import multiprocessing
import os
import resource
import signal
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable, Sequence

# What the cases' commands import lazily, imported once in the forkserver rather than in every case: torch and the CLI
# (report, controller), and ``export``/``serve``'s Lightning, transformers and the HTTP server (about 5 s once, a
# case then costs about a second instead of 6).
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
           entry: Callable[[list[str]], int | None] | None = None) -> None:
    """The forked case: limits first, then ``entry(argv)`` (the CLI's own ``main`` unless given) with its
    stdout/stderr in files."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # an abort leaves no core file behind
    out_fd = os.open(out_path, os.O_WRONLY)
    err_fd = os.open(err_path, os.O_WRONLY)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch

        torch.set_num_threads(1)
        from clova_train.cli import main

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


def _ready() -> None:
    """A child that does nothing: :func:`run_cli` starts one first, untimed, so the forkserver's preload (seconds,
    once per worker) never counts against a case's wall-clock limit."""


_started = False


def start_forkserver() -> None:
    """Start this worker's forkserver and wait for its preload (once; :func:`run_cli` calls it)."""
    global _started
    if not _started:
        process = _CONTEXT.Process(target=_ready)
        process.start()
        process.join()
        _started = True


def run_cli(argv: Sequence[str], *, timeout_s: float = 20.0, memory_mb: int = 6144, cpu_s: int = 20,
            entry: Callable[[list[str]], int | None] | None = None) -> CaseOutcome:
    """Run ``clova-train argv`` in a forked child under the limits and report what the user would see.

    Args:
        argv: the CLI arguments (without the program name).
        timeout_s: wall-clock limit; past it the child is killed and ``killed`` is ``"timeout"``.
        memory_mb: the child's address-space limit (``RLIMIT_AS``); the preloaded CLI and torch map ~3.3 GB of address space.
        cpu_s: the child's CPU-time limit (``RLIMIT_CPU``, ``SIGXCPU`` past it).
        entry: a module-level function run instead of the CLI's ``main`` (it gets ``argv``, returns the exit code).
    """
    with tempfile.NamedTemporaryFile("w+") as out, tempfile.NamedTemporaryFile("w+") as err:
        start_forkserver()
        process = _CONTEXT.Process(target=_child, args=(list(argv), out.name, err.name, memory_mb, cpu_s, entry))
        process.start()
        process.join(timeout_s)
        killed = None
        if process.is_alive():
            process.kill()
            process.join()
            killed = "timeout"
        code = process.exitcode
        if killed is None and code is not None and code < 0:
            killed = "timeout" if -code == signal.SIGXCPU else f"signal {-code}"
        if code == 99:
            killed = "memory"
        return CaseOutcome(None if code is None or code < 0 else code, killed, open(out.name).read(),
                           open(err.name).read())


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
