"""The sandbox worker's system-call filter alone (restriction layer off, raw system calls through ctypes), issue 53.

Each case is a program run in one shared worker with full Python; it makes system calls by number (resolved by
libseccomp for this machine) and reports what each returned. Every one must be refused with EPERM by the filter,
the training process (this one) must receive no signal, and the next run must work:

* **timers and its own signals**: ``alarm``, ``setitimer``, ``timer_create``, ``timerfd_create``, ``signalfd``, a
  handler or ``SIG_IGN`` for SIGALRM/SIGXCPU, blocking signals; then it sleeps past the timers it tried to arm
  (a timer that went off would end the worker);
* **signals to other processes**: ``fcntl`` ``F_SETOWN``/``F_SETOWN_EX``/``F_SETSIG``/``O_ASYNC``/lease/notify on
  every descriptor, ``ioctl`` ``FIOSETOWN``/``SIOCSPGRP``/``FIOASYNC``, ``kill``/``tkill``/``tgkill``/
  ``rt_sigqueueinfo``/``pidfd_send_signal`` naming this process or its group;
* **output anywhere but its channel**: every way to write bytes (``write``, ``pwrite64``, ``writev``,
  ``pwritev``, ``sendto``, ``sendmsg``, ``sendmmsg``, ``sendfile``, ``splice``, ``tee``, ``vmsplice``,
  ``copy_file_range``) to each descriptor it holds but was not given, reads from them, a flood through
  ``sys.stdout``; on the channel itself the calls the worker does not use (vectored, message, positional, urgent
  data, an address), ``io_uring_setup`` and ``process_vm_writev``.

The worker's own time limit still ends it: a program that lowers its own ``RLIMIT_CPU`` (allowed) and tries to
ignore or block SIGXCPU (refused) dies of it long before the wall-time limit.
"""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import pytest

from clova_train.sandbox import Sandbox

pyseccomp = pytest.importorskip("pyseccomp")

SYSCALLS = (
    "alarm", "setitimer", "timer_create", "timerfd_create", "signalfd", "signalfd4", "rt_sigaction",
    "rt_sigprocmask", "fcntl", "ioctl", "kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo",
    "pidfd_open", "pidfd_send_signal", "read", "write", "pwrite64", "writev", "pwritev", "pwritev2", "recvfrom",
    "sendto", "sendmsg", "sendmmsg", "sendfile", "splice", "tee", "vmsplice", "copy_file_range", "io_uring_setup",
    "process_vm_writev",
)

PRELUDE = """
import ctypes, os, stat
NR = __NR__
P, G = __PARENT__, __GROUP__
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
results = {}

def is_socket(fd):
    try:
        return stat.S_ISSOCK(os.fstat(fd).st_mode)
    except OSError:
        return False

CH = [fd for fd in range(64) if is_socket(fd)][0]
HELD = [fd for fd in range(CH + 1) if fd != CH]

def call(label, name, *args):
    if name in NR:  # a call this architecture does not have is not tried
        ctypes.set_errno(0)
        ret = libc.syscall(ctypes.c_long(NR[name]), *[ctypes.c_long(a) if type(a) is int else a for a in args])
        results[label] = [ret, ctypes.get_errno()]

def python_call(label, function):
    try:
        function()
        results[label] = 'done'
    except OSError as err:
        results[label] = [-1, err.errno]

buf = ctypes.create_string_buffer(4096)
iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 64)
empty_iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 0)
msg = (ctypes.c_void_p * 7)(0, 0, ctypes.addressof(empty_iov), 1, 0, 0, 0)
mmsg = (ctypes.c_void_p * 8)(0, 0, ctypes.addressof(empty_iov), 1, 0, 0, 0, 0)
ignore = (ctypes.c_ulong * 4)(1, 0, 0, 0)
all_signals = (ctypes.c_ulong * 1)(2 ** 64 - 1)
"""

TIMERS = """
timer = (ctypes.c_long * 4)(0, 10000, 0, 10000)
call('alarm', 'alarm', 1)
for which in (0, 1, 2):
    call(f'setitimer {which}', 'setitimer', which, timer, 0)
timer_id = ctypes.c_int(0)
call('timer_create', 'timer_create', 0, 0, ctypes.byref(timer_id))
call('timerfd_create', 'timerfd_create', 1, 0)
call('signalfd', 'signalfd', -1, all_signals, 8)
call('signalfd4', 'signalfd4', -1, all_signals, 8, 0)
for sig in (14, 24, 26, 27):
    call(f'rt_sigaction {sig} SIG_IGN', 'rt_sigaction', sig, ignore, 0, 8)
for how in (0, 2):
    call(f'rt_sigprocmask {how}', 'rt_sigprocmask', how, all_signals, 0, 8)
import signal, time
python_call('signal.alarm', lambda: signal.alarm(1))
python_call('signal.setitimer', lambda: signal.setitimer(signal.ITIMER_REAL, 0.01))
python_call('signal.signal', lambda: signal.signal(signal.SIGALRM, lambda *a: None))
python_call('signal.pthread_sigmask', lambda: signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGXCPU}))
time.sleep(1.1)
final_answer = results
"""

SIGNALS = """
owner = (ctypes.c_int * 2)(1, P)
pid = ctypes.c_int(P)
one = ctypes.c_int(1)
info = ctypes.create_string_buffer(128)
for fd in range(CH + 1):
    call(f'F_SETOWN {fd}', 'fcntl', fd, 8, P)
    call(f'F_SETOWN group {fd}', 'fcntl', fd, 8, -G)
    call(f'F_SETOWN_EX {fd}', 'fcntl', fd, 15, owner)
    call(f'F_SETSIG {fd}', 'fcntl', fd, 10, 9)
    call(f'F_SETFL O_ASYNC {fd}', 'fcntl', fd, 4, 0o20000 | 0o4000)
    call(f'F_SETLEASE {fd}', 'fcntl', fd, 1024, 1)
    call(f'F_NOTIFY {fd}', 'fcntl', fd, 1026, 0x80000001)
    call(f'FIOSETOWN {fd}', 'ioctl', fd, 0x8901, ctypes.byref(pid))
    call(f'SIOCSPGRP {fd}', 'ioctl', fd, 0x8902, ctypes.byref(pid))
    call(f'FIOASYNC {fd}', 'ioctl', fd, 0x5452, ctypes.byref(one))
    call(f'F_SETOWN high bits {fd}', 'fcntl', fd, 8 | (1 << 32), P)
for target in (P, -G, -1):
    call(f'kill {target}', 'kill', target, 0)
call('tkill', 'tkill', P, 0)
call('tgkill', 'tgkill', P, P, 0)
call('rt_sigqueueinfo', 'rt_sigqueueinfo', P, 0, info)
call('rt_tgsigqueueinfo', 'rt_tgsigqueueinfo', P, P, 0, info)
call('pidfd_open', 'pidfd_open', P, 0)
call('pidfd_send_signal', 'pidfd_send_signal', CH, 0, 0, 0)
import fcntl
python_call('fcntl.fcntl F_SETOWN', lambda: fcntl.fcntl(CH, fcntl.F_SETOWN, P))
final_answer = results
"""

WRITES = """
for fd in HELD:
    call(f'write {fd}', 'write', fd, buf, 4096)
    call(f'pwrite64 {fd}', 'pwrite64', fd, buf, 64, 0)
    call(f'writev {fd}', 'writev', fd, iov, 1)
    call(f'pwritev {fd}', 'pwritev', fd, iov, 1, 0, 0)
    call(f'pwritev2 {fd}', 'pwritev2', fd, iov, 1, 0, 0, 0)
    call(f'sendto {fd}', 'sendto', fd, buf, 64, 0, 0, 0)
    call(f'sendmsg {fd}', 'sendmsg', fd, msg, 0)
    call(f'sendmmsg {fd}', 'sendmmsg', fd, mmsg, 1, 0)
    call(f'sendfile {fd}', 'sendfile', fd, CH, 0, 64)
    call(f'splice {fd}', 'splice', CH, 0, fd, 0, 64, 0)
    call(f'tee {fd}', 'tee', CH, fd, 64, 0)
    call(f'vmsplice {fd}', 'vmsplice', fd, iov, 1, 0)
    call(f'copy_file_range {fd}', 'copy_file_range', CH, 0, fd, 0, 64, 0)
    call(f'read {fd}', 'read', fd, buf, 64)
    call(f'recvfrom {fd}', 'recvfrom', fd, buf, 64, 0, 0, 0)
call('write fd high bits', 'write', CH | (1 << 32), buf, 0)
call('channel writev', 'writev', CH, empty_iov, 1)
call('channel pwrite64', 'pwrite64', CH, buf, 0, 0)
call('channel sendmsg', 'sendmsg', CH, msg, 0)
call('channel sendmmsg', 'sendmmsg', CH, mmsg, 1, 0)
call('channel sendto MSG_OOB', 'sendto', CH, buf, 0, 1, 0, 0)
call('channel sendto address', 'sendto', CH, buf, 0, 0, buf, 16)
call('channel recvfrom MSG_PEEK', 'recvfrom', CH, buf, 0, 2, 0, 0)
call('io_uring_setup', 'io_uring_setup', 4, buf)
call('process_vm_writev', 'process_vm_writev', P, iov, 1, iov, 1, 0)
import io, sys
python_call('sys.stdout flood', lambda: (sys.stdout.write('x' * 10 ** 6), sys.stdout.flush()))
python_call('FileIO(1) flood', lambda: io.FileIO(1, 'w', closefd=False).write(b'x' * 10 ** 6))
python_call('FileIO(2) flood', lambda: io.FileIO(2, 'w', closefd=False).write(b'x' * 10 ** 6))
final_answer = results
"""

OWN_TIME_LIMIT = """
import resource
used = resource.getrusage(resource.RUSAGE_SELF)
resource.setrlimit(resource.RLIMIT_CPU, (int(used.ru_utime + used.ru_stime) + 1, resource.RLIM_INFINITY))
call('ignore SIGXCPU', 'rt_sigaction', 24, ignore, 0, 8)
call('block SIGXCPU', 'rt_sigprocmask', 0, all_signals, 0, 8)
while True:
    pass
"""


class Tools:
    def find(self, patch, name):
        return [(0, 0, 4, 4)]


def _numbers() -> dict[str, int]:
    numbers = {}
    for name in SYSCALLS:
        try:
            number = pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name)
        except (ValueError, OSError, RuntimeError):
            continue
        if number >= 0:  # negative: a pseudo-number for a call this architecture lacks
            numbers[name] = number
    return numbers


def program(body: str) -> str:
    prelude = (PRELUDE.replace("__NR__", repr(_numbers())).replace("__PARENT__", str(os.getpid()))
               .replace("__GROUP__", str(os.getpgid(0))))
    return prelude + body


@pytest.fixture(scope="module")
def worker() -> Sandbox:
    if "Seccomp:" not in Path("/proc/self/status").read_text():
        pytest.skip("no seccomp on this kernel")
    with Sandbox(timeout_s=3.0, memory_limit_mb=200, restricted=False) as sandbox:
        assert sandbox.run("x = 1", {}, Tools(), "img", (8, 8)).ok
        if not sandbox.isolation["seccomp"].startswith("on"):
            pytest.skip(f"the filter is off here: {sandbox.isolation['seccomp']}")
        yield sandbox


@pytest.fixture
def signals_received() -> list[int]:
    """Signals this (the training) process receives during the test that a worker could aim at it."""
    received: list[int] = []
    watched = (signal.SIGIO, signal.SIGURG, signal.SIGALRM, signal.SIGWINCH)
    previous = {sig: signal.signal(sig, lambda number, frame: received.append(number)) for sig in watched}
    yield received
    for sig, handler in previous.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("name,body", [("timers", TIMERS), ("signals", SIGNALS), ("writes", WRITES)])
def test_the_filter_refuses_it_and_both_processes_go_on(name: str, body: str, worker: Sandbox,
                                                        signals_received: list[int]) -> None:
    result = worker.run(program(body), {}, Tools(), "img", (8, 8))
    assert result.ok, result
    calls = result.variables["final_answer"]
    assert len(calls) >= 10, calls
    allowed = {label: outcome for label, outcome in calls.items() if outcome != [-1, errno.EPERM]}
    assert not allowed, f"not refused by the filter: {allowed}"
    after = worker.run("final_answer = len(image_patch.find('x'))", {}, Tools(), "img", (8, 8))
    assert after.ok and after.variables["final_answer"] == 1, after
    assert signals_received == []


def test_the_workers_own_time_limit_cannot_be_caught_or_blocked(worker: Sandbox) -> None:
    result = worker.run(program(OWN_TIME_LIMIT), {}, Tools(), "img", (8, 8))
    assert result.status == "crashed" and result.seconds < 2.5, result  # SIGXCPU, before the 3 s wall-time kill
    after = worker.run("final_answer = len(image_patch.find('x'))", {}, Tools(), "img", (8, 8))
    assert after.ok and after.variables["final_answer"] == 1, after
