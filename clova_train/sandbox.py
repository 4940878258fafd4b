"""Sandboxed execution of LLM-generated Python against the visual tool API (HYDRA's reasoner, ViperGPT's API).

Three layers, each enough to stop the attacks the tests try, together defence in depth:

1. **Static check** (:func:`check_code`): no ``import``, no class definitions, no names or attributes that
   start with ``_`` (this closes ``().__class__.__base__.__subclasses__()`` and friends), no frame/code
   attributes (``gi_frame``, ``f_globals``, ...), no ``str.format`` (it reaches attributes by name), and no
   ``open``/``eval``/``exec``/``getattr``/... names. A failed check is a ``violation`` and the code never runs.
2. **Restricted globals**: the code sees a small set of safe builtins, ``ImagePatch``, ``image_patch``,
   ``llm_query`` and the variables kept from earlier steps; nothing else.
3. **A separate worker process** (a fresh interpreter, so it holds no model weights and never re-imports the
   caller's ``__main__``) with an address-space limit
   (memory bomb -> ``memory``), no file-size budget, no spare file descriptors (no new files or sockets),
   ``os.fork``/``os.system``/... replaced by stubs that raise, and a wall-time limit enforced by the parent,
   which kills and restarts the worker (infinite loop -> ``timeout``).

Tool calls (``patch.find("red circle")``) are forwarded from the worker to the parent over the pipe, so the
tools (possibly GPU models, e.g. this package's prompt-tuned CLIP) live in the training process and the
worker stays small.

Variables persist across steps explicitly: :meth:`Sandbox.run` takes the variables from earlier steps and
returns the new ones (plain data and ``ImagePatch`` only); the caller keeps them. Nothing lives in the
worker between runs, so a killed worker loses nothing.

The code ends a task by assigning ``final_answer``.
"""

from __future__ import annotations

import ast
import io
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Literal, Protocol

Status = Literal["ok", "error", "violation", "timeout", "memory", "crashed"]

DENIED_NAMES = frozenset({
    "open", "eval", "exec", "compile", "globals", "locals", "vars", "getattr", "setattr", "delattr", "dir",
    "input", "breakpoint", "help", "exit", "quit", "memoryview", "type", "object", "super", "classmethod",
    "staticmethod", "property", "__import__", "__builtins__", "__loader__", "__spec__",
})
DENIED_ATTRIBUTES = frozenset({
    "format", "format_map", "mro", "gi_frame", "gi_code", "gi_yieldfrom", "cr_frame", "cr_code", "ag_frame",
    "ag_code", "f_globals", "f_locals", "f_builtins", "f_back", "f_code", "tb_frame", "tb_next", "co_code",
    "func_globals",
})
SAFE_BUILTINS = {
    name: __builtins__[name] if isinstance(__builtins__, dict) else getattr(__builtins__, name)
    for name in (
        "abs", "all", "any", "bool", "dict", "enumerate", "filter", "float", "int", "isinstance", "len", "list",
        "map", "max", "min", "range", "reversed", "round", "set", "sorted", "str", "sum", "tuple", "zip",
        "ValueError", "TypeError", "KeyError", "IndexError", "Exception", "ZeroDivisionError",
    )
}
TOOL_METHODS = frozenset({"find", "exists", "verify_property", "simple_query", "crop", "compute_depth", "llm_query"})


class SandboxViolation(Exception):
    """The code uses something the sandbox does not allow (reported, never executed)."""


def check_code(source: str) -> ast.Module:
    """Parse ``source`` and raise :class:`SandboxViolation` naming the first thing the sandbox forbids."""
    tree = ast.parse(source, mode="exec")
    for node in ast.walk(tree):
        line = getattr(node, "lineno", "?")
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or "."]
            raise SandboxViolation(f"line {line}: import of {', '.join(names)} is not allowed")
        if isinstance(node, (ast.ClassDef, ast.AsyncFunctionDef, ast.Global, ast.Nonlocal)):
            raise SandboxViolation(f"line {line}: {type(node).__name__} is not allowed")
        if isinstance(node, ast.Name) and (node.id.startswith("_") or node.id in DENIED_NAMES):
            raise SandboxViolation(f"line {line}: name {node.id!r} is not allowed")
        if isinstance(node, ast.Attribute) and (node.attr.startswith("_") or node.attr in DENIED_ATTRIBUTES):
            raise SandboxViolation(f"line {line}: attribute {node.attr!r} is not allowed")
    return tree


@dataclass(frozen=True)
class PatchRef:
    """What a tool needs to know about an image patch: its image and its box (pixels, y from the bottom)."""

    image_id: str
    left: int
    lower: int
    right: int
    upper: int


class ToolAPI(Protocol):
    """The parent-side tools behind ``ImagePatch``. Box results are ``(left, lower, right, upper)``."""

    def find(self, patch: PatchRef, object_name: str) -> list[tuple[int, int, int, int]]: ...
    def exists(self, patch: PatchRef, object_name: str) -> bool: ...
    def verify_property(self, patch: PatchRef, object_name: str, attribute: str) -> bool: ...
    def simple_query(self, patch: PatchRef, question: str) -> str: ...
    def compute_depth(self, patch: PatchRef) -> float: ...
    def llm_query(self, patch: PatchRef | None, question: str) -> str: ...


@dataclass
class ExecutionResult:
    """The outcome of one sandboxed run."""

    status: Status
    variables: dict[str, Any] = field(default_factory=dict)
    stdout: str = ""
    error: str = ""
    tool_calls: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# ---------------------------------------------------------------------------------------------- worker side
_CONNECTION: Connection | None = None


def _tool_call(method: str, patch: PatchRef | None, *args: Any) -> Any:
    assert _CONNECTION is not None
    _CONNECTION.send(("call", method, patch, args))
    kind, value = _CONNECTION.recv()
    if kind == "error":
        raise RuntimeError(value)
    return value


class ImagePatch:
    """A crop of the task image (ViperGPT's API). Coordinates are pixels with y measured from the bottom."""

    def __init__(self, image_id: str, left: int, lower: int, right: int, upper: int) -> None:
        self.image_id, self.left, self.lower, self.right, self.upper = image_id, left, lower, right, upper
        self.width = right - left
        self.height = upper - lower
        self.horizontal_center = (left + right) / 2
        self.vertical_center = (lower + upper) / 2

    def _ref(self) -> PatchRef:
        return PatchRef(self.image_id, self.left, self.lower, self.right, self.upper)

    def find(self, object_name: str) -> list[ImagePatch]:
        """Patches of every ``object_name`` in this patch, left to right."""
        return [ImagePatch(self.image_id, *box) for box in _tool_call("find", self._ref(), object_name)]

    def exists(self, object_name: str) -> bool:
        return bool(_tool_call("exists", self._ref(), object_name))

    def verify_property(self, object_name: str, attribute: str) -> bool:
        return bool(_tool_call("verify_property", self._ref(), object_name, attribute))

    def simple_query(self, question: str) -> str:
        return str(_tool_call("simple_query", self._ref(), question))

    def crop(self, left: int, lower: int, right: int, upper: int) -> ImagePatch:
        return ImagePatch(self.image_id, max(left, self.left), max(lower, self.lower),
                          min(right, self.right), min(upper, self.upper))

    def compute_depth(self) -> float:
        return float(_tool_call("compute_depth", self._ref()))

    def llm_query(self, question: str) -> str:
        return str(_tool_call("llm_query", self._ref(), question))

    def __repr__(self) -> str:
        return f"ImagePatch({self.left}, {self.lower}, {self.right}, {self.upper})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ImagePatch) and self._ref() == other._ref()


def llm_query(question: str) -> str:
    """Ask the language model a question that needs no image."""
    return str(_tool_call("llm_query", None, question))


def _is_data(value: Any, depth: int = 0) -> bool:
    if value is None or isinstance(value, (bool, int, float, str, ImagePatch)):
        return True
    if depth < 4 and isinstance(value, (list, tuple, set)):
        return all(_is_data(v, depth + 1) for v in value)
    if depth < 4 and isinstance(value, dict):
        return all(isinstance(k, (str, int)) and _is_data(v, depth + 1) for k, v in value.items())
    return False


def _denied(*args: Any, **kwargs: Any) -> Any:
    raise PermissionError("not allowed in the sandbox")


def _lock_down(memory_limit_mb: int) -> None:
    import resource

    with open("/proc/self/status") as status:  # the worker's own size: the limit is on top of it
        vm_kb = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    limit = (vm_kb * 1024) + memory_limit_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    try:
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    except (ValueError, OSError):
        pass
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    while (spare := os.open(os.devnull, os.O_RDONLY)) < highest:  # fill the gaps below the highest descriptor
        pass
    os.close(spare)
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1, highest + 1))
    for name in ("fork", "forkpty", "system", "popen", "execv", "execve", "execvp", "spawnv", "spawnve",
                 "posix_spawn", "posix_spawnp", "kill", "remove", "unlink", "rmdir", "rename", "replace"):
        if hasattr(os, name):
            setattr(os, name, _denied)


def _execute(source: str, variables: dict[str, Any], image_id: str, size: tuple[int, int]) -> ExecutionResult:
    stdout = io.StringIO()

    def captured_print(*args: Any, **kwargs: Any) -> None:
        kwargs.pop("file", None)
        print(*args, file=stdout, **kwargs)

    scope: dict[str, Any] = {
        "__builtins__": {**SAFE_BUILTINS, "print": captured_print},
        "ImagePatch": ImagePatch,
        "image_patch": ImagePatch(image_id, 0, 0, size[0], size[1]),
        "llm_query": llm_query,
    }
    reserved = set(scope)
    scope.update(variables)
    try:
        exec(compile(source, "<generated>", "exec"), scope)  # noqa: S102 (checked source, restricted scope)
        status, error = "ok", ""
    except MemoryError:
        status, error = "memory", "MemoryError: the code exceeded the sandbox memory limit"
    except RecursionError as err:
        status, error = "error", f"RecursionError: {err}"
    except Exception as err:  # noqa: BLE001 (any failure of generated code is feedback)
        status, error = "error", f"{type(err).__name__}: {err}"
    kept = {k: v for k, v in scope.items() if k not in reserved and not k.startswith("_") and _is_data(v)}
    return ExecutionResult(status, kept, stdout.getvalue()[-2000:], error)


def _worker_main(fd: int, memory_limit_mb: int) -> None:
    global _CONNECTION
    connection = _CONNECTION = Connection(fd)
    _lock_down(memory_limit_mb)
    while True:
        try:
            message = connection.recv()
        except EOFError:
            return
        if message[0] == "stop":
            return
        _, source, variables, image_id, size = message
        try:
            result = _execute(source, variables, image_id, size)
        except MemoryError:
            result = ExecutionResult("memory", error="MemoryError: the code exceeded the sandbox memory limit")
        connection.send(("done", result))


# ---------------------------------------------------------------------------------------------- parent side
class Sandbox:
    """Runs generated code in a locked-down worker process, forwarding tool calls to ``tools``.

    Args:
        timeout_s: wall-time limit for one run, tool calls included.
        memory_limit_mb: address space the worker may add on top of its own size at start.
    """

    def __init__(self, timeout_s: float = 2.0, memory_limit_mb: int = 256) -> None:
        self.timeout_s = timeout_s
        self.memory_limit_mb = memory_limit_mb
        self._process: subprocess.Popen | None = None
        self._connection: Connection | None = None
        self.restarts = 0

    def _start(self) -> None:
        parent, child = socket.socketpair()
        command = f"from clova_train.sandbox import _worker_main; _worker_main({child.fileno()}, {self.memory_limit_mb})"
        self._process = subprocess.Popen(
            [sys.executable, "-c", command], pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        child.close()
        self._connection = Connection(parent.detach())

    def _alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def _kill(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait(timeout=5)
        if self._connection is not None:
            self._connection.close()
        self._process = self._connection = None
        self.restarts += 1

    def close(self) -> None:
        if self._alive() and self._connection is not None:
            try:
                self._connection.send(("stop",))
                self._process.wait(timeout=1)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                pass
        if self._alive():
            self._process.kill()
            self._process.wait()
        if self._connection is not None:
            self._connection.close()
        self._process = self._connection = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:  # environments are pickled into SubprocVecEnv workers
        return {"timeout_s": self.timeout_s, "memory_limit_mb": self.memory_limit_mb}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)

    def run(self, source: str, variables: dict[str, Any], tools: ToolAPI, image_id: str,
            size: tuple[int, int]) -> ExecutionResult:
        """Check and run ``source``; never raises for anything the code does."""
        started = time.perf_counter()
        try:
            check_code(source)
        except SyntaxError as err:
            return ExecutionResult("error", dict(variables), error=f"SyntaxError: {err.msg} (line {err.lineno})")
        except SandboxViolation as err:
            return ExecutionResult("violation", dict(variables), error=f"sandbox violation: {err}")
        if not self._alive():
            self._start()
        assert self._connection is not None
        calls = 0
        try:
            self._connection.send(("run", source, variables, image_id, size))
            while True:
                remaining = self.timeout_s - (time.perf_counter() - started)
                if remaining <= 0 or not self._connection.poll(remaining):
                    self._kill()
                    return ExecutionResult("timeout", dict(variables), error=f"timeout: the code ran over "
                                           f"{self.timeout_s:g} s and was stopped", tool_calls=calls,
                                           seconds=time.perf_counter() - started)
                message = self._connection.recv()
                if message[0] == "done":
                    result: ExecutionResult = message[1]
                    result.tool_calls, result.seconds = calls, time.perf_counter() - started
                    if result.status == "memory":
                        self._kill()  # a worker that hit its memory limit is not trusted again
                    return result
                _, method, patch, args = message
                calls += 1
                self._connection.send(self._serve(tools, method, patch, args))
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError) as err:
            self._kill()
            return ExecutionResult("crashed", dict(variables), error=f"the sandbox worker died ({type(err).__name__})",
                                   tool_calls=calls, seconds=time.perf_counter() - started)

    @staticmethod
    def _serve(tools: ToolAPI, method: str, patch: PatchRef | None, args: tuple) -> tuple[str, Any]:
        if method not in TOOL_METHODS:
            return ("error", f"unknown tool {method!r}")
        try:
            return ("result", getattr(tools, method)(patch, *args))
        except Exception as err:  # noqa: BLE001 (a failing tool is feedback for the agent)
            return ("error", f"{method} failed: {type(err).__name__}: {err}")
