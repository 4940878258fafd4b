"""The sandbox worker's seccomp filter: which system calls it may make, and with which arguments (Linux).

An allowlist built with libseccomp (through pyseccomp); every call not on it fails with EPERM before the kernel
does anything. What the worker still needs after lock-down is small: memory, clocks and sleeping, its own
resource limits and usage, and reading and writing the one socket to the parent. Three kinds of rule:

* :data:`ALWAYS_ALLOWED`: calls that touch only the worker itself, whatever their arguments.
* **Input and output only on the descriptors it was given** (the channel to the parent): ``read``, ``write``,
  ``recvfrom`` and ``sendto`` with the descriptor in the first argument, flags 0 and no address. Its standard
  streams (``/dev/null``), the ``/dev/null`` descriptors that fill the gaps, and any other descriptor are refused,
  and so is every other way to write bytes somewhere: ``writev``, ``pwrite64``, ``sendmsg``/``sendmmsg`` (which
  also carry descriptors), ``sendfile``, ``splice``, ``tee``, ``vmsplice``, ``copy_file_range``, ``io_uring``,
  ``process_vm_writev`` are not on the list at all. ``MSG_OOB`` (urgent data, ``SIGURG``) is refused by the
  flags rule.
* **No signal it arranges**: no timer (``alarm``, ``setitimer``, ``timer_create``, ``timerfd_create``), no
  signal to any process (``kill``, ``tgkill``, ``tkill``, ``rt_sigqueueinfo``, ``pidfd_send_signal``), no
  descriptor made to signal a process (``fcntl`` only with ``F_GETFD``, ``F_SETFD``, ``F_GETFL`` and ``F_SETFL``
  without ``O_ASYNC``, so no ``F_SETOWN``/``F_SETOWN_EX``/``F_SETSIG``/``F_SETLEASE``/``F_NOTIFY``; no ``ioctl``,
  so no ``FIOSETOWN``/``SIOCSPGRP``/``FIOASYNC``), and no handler or blocked mask of its own: ``rt_sigaction``
  may only read a disposition and ``rt_sigprocmask`` only read the mask or unblock, so the worker's own time
  limit (``SIGXCPU`` from ``RLIMIT_CPU``) can be neither caught nor blocked. ``prlimit64`` only on the worker
  itself (pid 0 or its own).

Arguments are compared as 64-bit values and only for equality (or a masked equality of zero), so a descriptor or
command number with stray high bits matches no rule and is refused.
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Collection
from typing import Any

ALWAYS_ALLOWED = (
    "close", "fstat", "newfstatat", "lseek", "mmap", "munmap", "mremap", "brk", "madvise", "mprotect", "futex",
    "rt_sigreturn", "sigaltstack", "exit", "exit_group", "getpid", "gettid", "getrandom", "clock_gettime",
    "clock_getres", "gettimeofday", "clock_nanosleep", "nanosleep", "sched_yield", "getrusage", "getrlimit",
    "setrlimit", "getuid", "geteuid", "getgid", "getegid", "poll", "ppoll", "select", "pselect6", "restart_syscall",
)
CHANNEL_IO = ("read", "write")  # the descriptor is argument 0
CHANNEL_SOCKET_IO = ("recvfrom", "sendto")  # and also flags (argument 3) 0 and no address (argument 4)
F_GETFD, F_SETFD, F_GETFL, F_SETFL = 1, 2, 3, 4  # Linux's numbers (the fcntl module lacks some on other systems)
O_ASYNC = getattr(os, "O_ASYNC", 0o20000)
SIG_UNBLOCK = int(getattr(signal, "SIG_UNBLOCK", 1))


def _rules(pyseccomp: Any, channel_fds: Collection[int]) -> list[tuple[str, tuple[Any, ...]]]:
    """Every allowed (call, argument conditions) pair; the conditions of one pair must all hold."""
    def eq(arg: int, value: int) -> Any:
        return pyseccomp.Arg(arg, pyseccomp.EQ, value)

    rules: list[tuple[str, tuple[Any, ...]]] = [(name, ()) for name in ALWAYS_ALLOWED]
    for fd in sorted(set(channel_fds)):
        rules += [(name, (eq(0, fd),)) for name in CHANNEL_IO]
        rules += [(name, (eq(0, fd), eq(3, 0), eq(4, 0))) for name in CHANNEL_SOCKET_IO]
    rules += [("fcntl", (eq(1, command),)) for command in (F_GETFD, F_SETFD, F_GETFL)]
    rules.append(("fcntl", (eq(1, F_SETFL), pyseccomp.Arg(2, pyseccomp.MASKED_EQ, O_ASYNC, 0))))
    rules.append(("rt_sigaction", (eq(1, 0),)))  # read a disposition, never install one
    rules += [("rt_sigprocmask", (eq(1, 0),)), ("rt_sigprocmask", (eq(0, SIG_UNBLOCK),))]
    # prlimit64 (what glibc's setrlimit calls) only on this process: with any pid, a worker that keeps the trainer's
    # uid (a trainer not started as root) could lower the trainer's own limits.
    rules += [("prlimit64", (eq(0, pid),)) for pid in (0, os.getpid())]
    return rules


def install(pyseccomp: Any, channel_fds: Collection[int]) -> str:
    """Load the filter into this process (irreversible); returns the layer's state, ``on: ...`` or ``off: why``.

    Args:
        pyseccomp: the imported module (imported before lock-down), or a string saying why it is missing,
            which is returned as the state.
        channel_fds: the descriptors this process was given and may read and write; no other one.
    """
    if isinstance(pyseccomp, str):
        return pyseccomp
    rules = pyseccomp.SyscallFilter(defaction=pyseccomp.ERRNO(errno.EPERM))
    for name, conditions in _rules(pyseccomp, channel_fds):
        try:
            rules.add_rule(pyseccomp.ALLOW, name, *conditions)
        except (ValueError, RuntimeError, OSError):  # a call this architecture does not have
            pass
    try:
        rules.load()
    except (OSError, RuntimeError, ValueError) as err:  # a kernel or container that refuses filters
        return f"off: the kernel refused the filter ({type(err).__name__}: {err})"
    fds = ", ".join(str(fd) for fd in sorted(set(channel_fds))) or "none"
    return (f"on: {len(ALWAYS_ALLOWED)} system calls allowed, input/output only on descriptor(s) {fds}, fcntl, "
            f"signal dispositions and prlimit64 with checked arguments; every other call fails with EPERM")
