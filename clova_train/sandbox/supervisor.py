"""The training-process side of the sandbox: starts the worker, enforces time, serves tool calls, trusts nothing.

:meth:`Sandbox.run` never raises for anything the code or the worker does; every outcome is an
:class:`ExecutionResult` with a status:

``ok``, ``error`` (the program raised, or did not parse), ``violation`` (the restriction layer refused it, a
value or message broke a limit, or the worker sent something malformed), ``timeout`` (wall time; the worker is
killed and restarted), ``memory`` (the worker's address-space limit), ``crashed`` (the worker died).

The parent reads only length-prefixed JSON under a size limit (:mod:`~clova_train.sandbox.wire`), checks each
tool call (known method, well-formed patch, a few short string arguments, at most ``max_tool_calls`` per run)
before a tool sees it, and keeps only bounded values.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from clova_train.core.errors import ClovaTrainError
from clova_train.sandbox import wire
from clova_train.sandbox.wire import PatchRef, WireError

Status = Literal["ok", "error", "violation", "timeout", "memory", "crashed"]
STATUSES = frozenset({"ok", "error", "violation", "timeout", "memory", "crashed"})
TOOL_METHODS = frozenset({"find", "exists", "verify_property", "simple_query", "compute_depth", "llm_query"})
MAX_TOOL_ARGUMENT_CHARS = 1000
log = logging.getLogger(__name__)
_RESULT_TYPES = {  # what each tool returns to the program, whatever types the tool implementation used
    "find": lambda boxes: [tuple(int(v) for v in box) for box in boxes],
    "exists": bool, "verify_property": bool, "compute_depth": float,
    "simple_query": lambda text: str(text)[:MAX_TOOL_ARGUMENT_CHARS * 4],
    "llm_query": lambda text: str(text)[:MAX_TOOL_ARGUMENT_CHARS * 4],
}


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
    """The outcome of one sandboxed run.

    ``variables`` are the variables kept after the run (plain data and :class:`PatchRef`), ``dropped`` the names
    of those that could not leave the worker (functions, values over the output budget).
    """

    status: Status
    variables: dict[str, Any] = field(default_factory=dict)
    stdout: str = ""
    error: str = ""
    tool_calls: int = 0
    seconds: float = 0.0
    dropped: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class SandboxError(ClovaTrainError):
    """The sandbox itself cannot work here (its worker does not start): a problem of the machine, not the code."""


class _Violation(Exception):
    """The worker broke the protocol or a limit: it is killed and the run reported as a violation."""


class Sandbox:
    """Runs generated code in a locked-down worker process, forwarding tool calls to ``tools``.

    Args:
        timeout_s: wall-time limit for one run, tool calls included.
        memory_limit_mb: address space the worker may add on top of its own size at start.
        max_code_chars: longest program accepted (longer ones are a violation and never sent).
        output_chars: budget of what a run returns: kept variables (characters plus elements) and printed text.
        max_message_bytes: largest message either side accepts.
        max_tool_calls: tool calls one run may make.
        restricted: ``False`` switches the restriction layer off (Python's full builtins, no RestrictedPython)
            so that tests can show the layers below it hold alone. Never for real use.
    """

    def __init__(self, timeout_s: float = 2.0, memory_limit_mb: int = 256, max_code_chars: int = 20_000,
                 output_chars: int = 65_536, max_message_bytes: int = 1 << 20, max_tool_calls: int = 256,
                 restricted: bool = True) -> None:
        limits = {"timeout_s": timeout_s, "memory_limit_mb": memory_limit_mb, "max_code_chars": max_code_chars,
                  "output_chars": output_chars, "max_message_bytes": max_message_bytes,
                  "max_tool_calls": max_tool_calls}
        bad = [f"{name} = {value!r}" for name, value in limits.items() if not (isinstance(value, (int, float))
                                                                              and 0 < value < float("inf"))]
        if bad or memory_limit_mb < 16:
            raise SandboxError(f"sandbox limits must be positive numbers (memory_limit_mb at least 16): "
                               f"{', '.join(bad) or f'memory_limit_mb = {memory_limit_mb}'}")
        self.timeout_s, self.memory_limit_mb = timeout_s, memory_limit_mb
        self.max_code_chars, self.output_chars = max_code_chars, output_chars
        self.max_message_bytes, self.max_tool_calls = max_message_bytes, max_tool_calls
        self.restricted = restricted
        self._process: subprocess.Popen | None = None
        self._connection: wire.Channel | None = None
        self.restarts = 0
        self._sequence = 0
        self.isolation: dict[str, str] = {}

    # ------------------------------------------------------------------ worker lifecycle
    def _start(self) -> None:
        parent, child = socket.socketpair()
        package_root = str(Path(__file__).resolve().parents[3])
        command = (f"import sys; sys.path.insert(0, {package_root!r}); "
                   f"from clova_train.sandbox.worker import main; "
                   f"main({child.fileno()}, {int(self.memory_limit_mb)}, {int(self.output_chars)}, "
                   f"{int(self.max_message_bytes)}, {bool(self.restricted)})")
        self._process = subprocess.Popen(
            [sys.executable, "-I", "-c", command], pass_fds=(child.fileno(),), env={}, cwd="/",
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        child.close()
        self._connection = wire.Channel(parent, self.max_message_bytes)
        try:
            ready = self._connection.receive(time.monotonic() + 60)
        except (TimeoutError, EOFError, OSError, WireError) as err:
            self._kill()
            raise SandboxError(f"the sandbox worker ({sys.executable}) did not start ({type(err).__name__}: {err}); "
                               f"{self._diagnose(package_root)}") from None
        report = ready.get("isolation")
        if isinstance(report, dict) and not self.isolation:
            self.isolation = {str(k): str(v)[:200] for k, v in report.items()}
            off = {k: v for k, v in self.isolation.items() if v.startswith("off")}
            if off:
                log.info("sandbox worker isolation layers off here: %s", off)

    @staticmethod
    def _diagnose(package_root: str) -> str:
        """Why the worker's imports fail, if they do (the worker itself has no stderr)."""
        probe = subprocess.run(
            [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {package_root!r}); "
             "import clova_train.sandbox.worker"], env={}, cwd="/", capture_output=True, text=True, timeout=60)
        lines = probe.stderr.strip().splitlines()
        return f"its imports fail: {lines[-1]}" if probe.returncode and lines else "its imports work"

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
                self._connection.send({"op": "stop"})
                self._process.wait(timeout=1)
            except (OSError, subprocess.TimeoutExpired):
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
        return {"timeout_s": self.timeout_s, "memory_limit_mb": self.memory_limit_mb,
                "max_code_chars": self.max_code_chars, "output_chars": self.output_chars,
                "max_message_bytes": self.max_message_bytes, "max_tool_calls": self.max_tool_calls,
                "restricted": self.restricted}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)

    # ------------------------------------------------------------------ running code
    def run(self, source: str, variables: dict[str, Any], tools: ToolAPI, image_id: str,
            size: tuple[int, int]) -> ExecutionResult:
        """Run ``source`` with ``variables`` in the worker; never raises for anything the code does."""
        started = time.perf_counter()
        kept = dict(variables)
        if not isinstance(source, str) or len(source) > self.max_code_chars:
            length = len(source) if isinstance(source, str) else 0
            return ExecutionResult("violation", kept, error=f"sandbox violation: the code is {length} characters, "
                                   f"over the limit of {self.max_code_chars}")
        try:
            encoded = wire.encode_value(variables, wire.Budget(self.output_chars))
        except (WireError, RecursionError) as err:
            return ExecutionResult("error", kept, error=f"variables cannot be sent to the sandbox: {err}")
        if not self._alive():
            self._start()
        assert self._connection is not None
        self._sequence += 1
        deadline = time.monotonic() + self.timeout_s
        calls = 0

        def finish(status: Status, error: str, **fields: Any) -> ExecutionResult:
            return ExecutionResult(status, fields.pop("variables", kept), error=error, tool_calls=calls,
                                   seconds=time.perf_counter() - started, **fields)

        try:
            self._connection.send({"op": "run", "seq": self._sequence, "code": source, "variables": encoded,
                                         "image": [str(image_id), int(size[0]), int(size[1])],
                                         "cpu_s": self.timeout_s})
            while True:
                message = self._connection.receive(deadline)
                if message.get("seq") != self._sequence:
                    raise _Violation("a message that does not belong to this run")
                if message["op"] == "done":
                    return self._done(message, finish)
                if message["op"] != "call":
                    raise _Violation(f"unexpected message {message['op'][:40]!r}")
                calls += 1
                if calls > self.max_tool_calls:
                    raise _Violation(f"more than {self.max_tool_calls} tool calls in one run")
                self._connection.send(self._serve(tools, message))
        except TimeoutError:
            self._kill()
            return finish("timeout", f"timeout: the code ran over {self.timeout_s:g} s and was stopped")
        except (_Violation, WireError) as err:
            self._kill()
            return finish("violation", f"sandbox violation: {err}")
        except (EOFError, OSError) as err:
            self._kill()
            return finish("crashed", f"the sandbox worker died ({type(err).__name__})")

    def _done(self, message: dict[str, Any], finish: Any) -> ExecutionResult:
        status = message.get("status")
        if status not in STATUSES:
            raise _Violation("malformed result status")
        try:
            variables = wire.decode_value(message.get("variables", {"$d": []}))
        except (RecursionError, MemoryError) as err:
            raise _Violation(f"malformed variables ({type(err).__name__})") from None
        if type(variables) is not dict or not all(type(k) is str for k in variables):
            raise _Violation("malformed variables")
        fields = {"stdout": message.get("stdout", ""), "error": message.get("error", "")}
        if not all(type(v) is str and len(v) <= self.output_chars + 100 for v in fields.values()):
            raise _Violation("malformed output")
        dropped = message.get("dropped", [])
        if type(dropped) is not list or not all(type(d) is str and len(d) <= 200 for d in dropped[:50]):
            raise _Violation("malformed list of dropped variables")
        if self._connection.pending():  # the caller kills a worker that breaks the protocol
            raise _Violation("the worker sent more than one result")
        if status == "memory":
            self._kill()  # a worker that hit its memory limit is not trusted again
        return finish(status, fields["error"], stdout=fields["stdout"], dropped=dropped[:50],
                      **({"variables": variables} if status == "ok" else {}))

    @staticmethod
    def _serve(tools: ToolAPI, message: dict[str, Any]) -> dict[str, Any]:
        """Check one tool call from the worker and answer it (a failing tool is an error for the program)."""
        method, box, args = message.get("method"), message.get("patch"), message.get("args")
        if method not in TOOL_METHODS:
            raise _Violation(f"unknown tool {str(method)[:40]!r}")
        patch = None if box is None and method == "llm_query" else PatchRef.from_box(box)
        if (type(args) is not list or len(args) > 3
                or not all(type(a) is str and len(a) <= MAX_TOOL_ARGUMENT_CHARS for a in args)):
            raise _Violation(f"malformed arguments for {method}")
        try:
            value = _RESULT_TYPES[method](getattr(tools, method)(patch, *args))
            return {"op": "result", "ok": True, "value": wire.encode_value(value, wire.Budget(1 << 16))}
        except Exception as err:  # noqa: BLE001 (a failing tool is feedback for the agent)
            return {"op": "result", "ok": False, "error": f"{method} failed: {type(err).__name__}: {str(err)[:300]}"}
