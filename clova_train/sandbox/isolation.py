"""The worker's operating-system layer: what the process itself can no longer do once it is locked down.

Applied by the worker after it has imported everything it needs and before it reads any code, in this order:

1. **File descriptors**: the gaps below the highest open descriptor are filled and ``RLIMIT_NOFILE`` is set
   to the count, so no new file, socket or pipe can be opened.
2. **Resource limits**: ``RLIMIT_AS`` (its own size plus ``memory_limit_mb``: a memory bomb is a
   MemoryError), ``RLIMIT_FSIZE`` 0 (no byte written to any file), ``RLIMIT_CORE`` 0, and ``RLIMIT_CPU``, set
   again before each run to that run's time limit (a backstop for the parent's wall-time kill).
3. **Privileges**: started as root, the worker drops to ``nobody`` (supplementary groups cleared, real,
   effective and saved ids changed), so file permissions and ``RLIMIT_NPROC`` apply to it; then
   ``RLIMIT_NPROC`` is 0 (no new process or thread).
4. **Python-level stubs**: process, file-descriptor and file-system functions of ``os``/``posix``, and the
   timer and signal functions of ``signal``/``_signal`` (``alarm``, ``setitimer``, ``signal``...), raise
   ``PermissionError`` (a convenience that makes a refusal visible: the layers around it do not rely on it).
5. **seccomp** (Linux, through libseccomp; the rules are :mod:`~clova_train.sandbox.syscall_filter`): an
   allowlist of system calls; every other call (``openat``, ``socket``, ``connect``, ``execve``, ``clone``,
   ``fork``, ``kill``, ``ptrace``, ``unlink``, ``alarm``, ``ioctl``...) fails with EPERM; reads and writes only
   on the descriptors the worker was given (its channel to the parent), ``fcntl`` without ``F_SETOWN``/``F_SETSIG``,
   no signal handler or blocked signal, ``prlimit64`` only on the worker itself. ``no_new_privs`` is set with it.

:func:`lock_down` returns which layers are on and, for any that is off, why (no libseccomp on this platform, not
root so no user change, ...); the parent logs it once and exposes it as :attr:`Sandbox.isolation`. Without
seccomp (macOS, a Linux without libseccomp) layers 1-4 and the restriction layer still hold.
"""

from __future__ import annotations

import errno
import os
import resource
import signal
import sys
from collections.abc import Collection
from typing import Any

from clova_train.sandbox import syscall_filter

STUBBED_FUNCTIONS = (
    "fork", "forkpty", "vfork", "system", "popen", "execv", "execve", "execvp", "execvpe", "execl", "execle",
    "execlp", "execlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl", "spawnle", "posix_spawn",
    "posix_spawnp", "kill", "killpg", "open", "openpty", "close", "closerange", "dup", "dup2", "pipe", "pipe2",
    "fdopen", "remove", "unlink", "rmdir", "mkdir", "makedirs", "rename", "replace", "link", "symlink", "chmod",
    "chown", "truncate", "ftruncate", "write", "putenv", "unsetenv", "setuid", "setgid", "chdir", "chroot",
    "listdir", "scandir", "stat", "lstat", "access", "readlink", "mkfifo", "mknod", "memfd_create",
)
SIGNAL_STUBS = (
    "alarm", "setitimer", "signal", "siginterrupt", "set_wakeup_fd", "pthread_kill", "pthread_sigmask",
    "raise_signal", "pidfd_send_signal", "sigwait", "sigwaitinfo", "sigtimedwait",
)
STANDARD_STREAMS = (0, 1, 2)
NOBODY = 65534


def _denied(*args: object, **kwargs: object) -> None:
    raise PermissionError(errno.EPERM, "not allowed in the sandbox")


def _close_spare_descriptors() -> None:
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 2
    while (spare := os.open(os.devnull, os.O_RDONLY)) < highest:
        pass
    os.close(spare)
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1, highest + 1))


def _address_space_now() -> int:
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    except (OSError, StopIteration):
        return 0


def _drop_privileges() -> str:
    if os.geteuid() != 0:
        return f"off: not started as root (uid {os.geteuid()}), runs as that user"
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)
    return f"on: uid/gid {NOBODY} (nobody)"


def _load_seccomp() -> Any:
    """pyseccomp, imported while imports still work, or the reason it is not there."""
    if not sys.platform.startswith("linux"):
        return f"off: seccomp is Linux-only (platform {sys.platform})"
    try:
        import pyseccomp
    except (ImportError, OSError, RuntimeError, AttributeError) as err:  # it loads libseccomp with ctypes
        return f"off: libseccomp is not available ({type(err).__name__}: {err})"
    return pyseccomp


def _install_seccomp(pyseccomp: Any, channel_fds: Collection[int] = STANDARD_STREAMS) -> str:
    """Load the system-call filter; ``channel_fds`` are the only descriptors left to read and write (the worker
    passes its channel to the parent; a plain process keeps its standard streams)."""
    return syscall_filter.install(pyseccomp, channel_fds)


def lock_down(memory_limit_mb: int, channel_fds: Collection[int]) -> dict[str, str]:
    """Apply layers 1-5 to this process (irreversible); returns each layer's state.

    Args:
        memory_limit_mb: address space the process may add to its size now.
        channel_fds: the descriptors it was given (its channel to the parent): the only ones it may read and write.
    """
    report: dict[str, str] = {}
    seccomp = _load_seccomp()
    _close_spare_descriptors()
    report["descriptors"] = "on: no spare file descriptors"
    limit = _address_space_now() + memory_limit_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    report["rlimits"] = f"on: address space +{memory_limit_mb} MiB, file size 0, CPU time per run"
    report["user"] = _drop_privileges()
    try:
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
        report["processes"] = "on: RLIMIT_NPROC 0"
    except (ValueError, OSError) as err:
        report["processes"] = f"off: {err}"
    for modules, names in (((os, sys.modules.get("posix")), STUBBED_FUNCTIONS),
                           ((signal, sys.modules.get("_signal")), SIGNAL_STUBS)):
        for module in modules:
            for name in names:
                if module is not None and hasattr(module, name):
                    setattr(module, name, _denied)
    report["stubs"] = "on: os/posix process and file functions, signal timers and handlers raise PermissionError"
    report["seccomp"] = _install_seccomp(seccomp, channel_fds)
    return report


def limit_cpu(seconds: float) -> None:
    """Let the coming run use about ``seconds`` more CPU time before SIGXCPU ends the worker."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    spent = int(used.ru_utime + used.ru_stime)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = spent + int(seconds) + 2
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
