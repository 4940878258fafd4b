"""The sandbox worker: a separate interpreter that compiles and runs generated code, one run at a time.

Started by :class:`~clova_train.sandbox.Sandbox` with an empty environment; it imports what it needs, locks
itself down (:mod:`~clova_train.sandbox.isolation`), reports which layers are on, then serves ``run`` messages:

* the code is compiled through the restriction layer (:mod:`~clova_train.sandbox.policy`); compiled programs
  are kept in a small cache, since a compiled code object holds no state of a run;
* every run gets a **fresh tool API**: a new ``ImagePatch`` class and ``llm_query`` function bound to this run,
  so nothing a program does to them (it cannot write their attributes anyway) reaches the next run;
* tool calls go to the parent as ``call`` messages and wait for its ``result``;
* when the program ends, its variables are checked here, before anything is sent: only plain data and image
  patches, within the output budget; an oversized or non-data ``final_answer`` fails the run.

Every failure of parsing, compiling or running the code becomes the run's status and message.
"""

from __future__ import annotations

import builtins
import socket
import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from clova_train.sandbox import isolation, policy, wire

MAX_ERROR_CHARS = 500
COMPILED_CACHE_SIZE = 256


class ToolError(Exception):
    """A tool call failed in the parent (the message says why)."""


class BoundedOutput:
    """What the program prints, up to ``limit`` characters (the rest is counted, not kept)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.parts, self.size, self.dropped = limit, [], 0, 0

    def write(self, text: str) -> None:
        room = self.limit - self.size
        if room > 0:
            self.parts.append(text[:room])
            self.size += min(len(text), room)
        self.dropped += max(0, len(text) - max(room, 0))

    def text(self) -> str:
        tail = f"\n[... {self.dropped} more characters not kept]" if self.dropped else ""
        return ("".join(self.parts) + tail).encode("utf-8", "replace").decode("utf-8")

    def print(self, *objects: Any, sep: Any = " ", end: Any = "\n", **ignored: Any) -> None:
        """``print`` into this buffer (the unrestricted mode's builtin; ``file=`` is ignored)."""
        sep = sep if type(sep) is str else " "
        end = end if type(end) is str else "\n"
        self.write(sep.join(str(o) for o in objects) + end)

    def collector(self, _getattr_: Any = None) -> Any:
        """RestrictedPython's ``_print_`` factory: every ``print`` of the run lands in this buffer."""
        output = self

        class Printer:
            def _call_print(self, *objects: Any, **options: Any) -> None:
                output.print(*objects, **options)

            def __call__(self) -> str:
                return output.text()

        return Printer()


Request = Callable[[dict[str, Any]], dict[str, Any]]


class Run:
    """One run's tool API: the ``ImagePatch`` class and ``llm_query`` a program sees, bound to this run only.

    Args:
        request: sends a ``call`` message to whoever serves the tools and returns its ``result`` message.
    """

    def __init__(self, request: Request) -> None:
        self.request = request
        self.ImagePatch = self._patch_class()

    def call(self, method: str, patch: Any, *args: Any) -> Any:
        box = None if patch is None else [patch.image_id, patch.left, patch.lower, patch.right, patch.upper]
        reply = self.request({"op": "call", "method": method, "patch": box,
                              "args": wire.encode_value(list(args), wire.Budget(4096))})
        if reply.get("op") != "result":
            raise ToolError("the parent sent no tool result")
        if not reply.get("ok"):
            raise ToolError(str(reply.get("error", "the tool failed"))[:MAX_ERROR_CHARS])
        return wire.decode_value(reply.get("value"), self.make_patch)

    def make_patch(self, box: list) -> Any:
        ref = wire.PatchRef.from_box(box)
        return self.ImagePatch(ref.image_id, ref.left, ref.lower, ref.right, ref.upper)

    def _patch_class(self) -> type:
        run = self

        class ImagePatch:
            """A crop of the task image (ViperGPT's API). Pixels, y measured from the bottom."""

            def __init__(self, image_id: str, left: int, lower: int, right: int, upper: int) -> None:
                self.image_id, self.left, self.lower, self.right, self.upper = (
                    str(image_id), int(left), int(lower), int(right), int(upper))
                self.width = self.right - self.left
                self.height = self.upper - self.lower
                self.horizontal_center = (self.left + self.right) / 2
                self.vertical_center = (self.lower + self.upper) / 2

            def find(self, object_name: str) -> list:
                """Patches of every ``object_name`` in this patch, left to right."""
                return [run.make_patch([self.image_id, *box]) for box in run.call("find", self, str(object_name))]

            def exists(self, object_name: str) -> bool:
                return bool(run.call("exists", self, str(object_name)))

            def verify_property(self, object_name: str, attribute: str) -> bool:
                return bool(run.call("verify_property", self, str(object_name), str(attribute)))

            def simple_query(self, question: str) -> str:
                return str(run.call("simple_query", self, str(question)))

            def crop(self, left: int, lower: int, right: int, upper: int) -> ImagePatch:
                return ImagePatch(self.image_id, max(int(left), self.left), max(int(lower), self.lower),
                                  min(int(right), self.right), min(int(upper), self.upper))

            def compute_depth(self) -> float:
                return float(run.call("compute_depth", self))

            def llm_query(self, question: str) -> str:
                return str(run.call("llm_query", self, str(question)))

            def __repr__(self) -> str:
                return f"ImagePatch({self.left}, {self.lower}, {self.right}, {self.upper})"

            def __eq__(self, other: object) -> bool:
                return isinstance(other, ImagePatch) and repr(self) == repr(other) and self.image_id == other.image_id

            __hash__ = None  # type: ignore[assignment]

        def llm_query(question: str) -> str:
            """Ask the language model a question that needs no image."""
            return str(run.call("llm_query", None, str(question)))

        self.llm_query = llm_query
        return ImagePatch

    def patch_box(self, value: Any) -> list | None:
        if type(value) is self.ImagePatch:
            return [value.image_id, value.left, value.lower, value.right, value.upper]
        return None


def _describe(err: BaseException) -> str:
    try:
        text = str(err)[:MAX_ERROR_CHARS]
    except Exception:  # noqa: BLE001 (an exception whose message itself fails)
        text = "(no message)"
    return f"{type(err).__name__}: {text}"[:MAX_ERROR_CHARS].encode("utf-8", "replace").decode("utf-8")


class Worker:
    """Compiles and runs programs; tool calls go through ``request``.

    Args:
        request: serves one tool call (the socket to the parent in the worker process).
        output_chars: budget of the kept variables (characters and elements) and of printed output.
        restricted: compile through the restriction layer (``False`` only to test the layers below it).
    """

    def __init__(self, request: Request, output_chars: int, restricted: bool = True) -> None:
        self.request, self.output_chars, self.restricted = request, output_chars, restricted
        self.compiled: OrderedDict[str, Any] = OrderedDict()

    def compile(self, source: str) -> Any:
        code = self.compiled.get(source)
        if code is None:
            code = policy.restricted_compile(source) if self.restricted else compile(source, "<generated>", "exec")
            self.compiled[source] = code
            if len(self.compiled) > COMPILED_CACHE_SIZE:
                self.compiled.popitem(last=False)
        else:
            self.compiled.move_to_end(source)
        return code

    def run(self, message: dict[str, Any]) -> dict[str, Any]:
        if message.get("cpu_s") is not None:
            isolation.limit_cpu(float(message["cpu_s"]))
        source = message.get("code")
        if type(source) is not str:
            return {"op": "done", "status": "violation", "error": "sandbox violation: no code"}
        try:
            code = self.compile(source)
        except policy.PolicyViolation as err:
            return {"op": "done", "status": "violation", "error": f"sandbox violation: {err}"[:MAX_ERROR_CHARS]}
        except SyntaxError as err:
            return {"op": "done", "status": "error", "error": f"SyntaxError: {err.msg} (line {err.lineno})"}
        except (RecursionError, MemoryError) as err:  # parser and compiler bombs
            return {"op": "done", "status": "violation",
                    "error": f"sandbox violation: the code is too deeply nested to compile ({type(err).__name__})"}
        except BaseException as err:  # noqa: BLE001 (e.g. a lone surrogate: UnicodeEncodeError)
            return {"op": "done", "status": "error", "error": _describe(err)}

        run = Run(self.request)
        output = BoundedOutput(self.output_chars)
        image_id, width, height = message["image"]
        scope: dict[str, Any] = {
            **({"__builtins__": policy.safe_builtins(), **policy.guards(), "_print_": output.collector}
               if self.restricted else {"__builtins__": {**vars(builtins), "print": output.print}}),
            "ImagePatch": run.ImagePatch, "llm_query": run.llm_query,
            "image_patch": run.ImagePatch(image_id, 0, 0, width, height),
        }
        reserved = set(scope)
        try:
            incoming = wire.decode_value(message.get("variables", {"$d": []}), run.make_patch)
        except wire.WireError as err:
            return {"op": "done", "status": "error", "error": f"variables could not be restored: {err}"}
        scope.update({k: v for k, v in incoming.items() if type(k) is str and k not in reserved
                      and not k.startswith("_")})
        status, error = "ok", ""
        try:
            exec(code, scope)  # noqa: S102 (restricted code, guarded scope, locked-down process)
        except MemoryError:
            status, error = "memory", "MemoryError: the code exceeded the sandbox memory limit"
        except ToolError as err:
            status, error = "error", f"tool call failed: {err}"
        except BaseException as err:  # noqa: BLE001 (any failure of generated code is feedback)
            status, error = "error", _describe(err)
        scope.pop("__builtins__", None)
        return {"op": "done", "status": status, "error": error, "stdout": output.text(),
                **self.kept(scope, reserved, run)}

    def kept(self, scope: dict[str, Any], reserved: set[str], run: Run) -> dict[str, Any]:
        """The variables that leave the worker, checked and encoded here under the output budget."""
        budget = wire.Budget(self.output_chars)
        variables: list[list[Any]] = []
        dropped: list[str] = []
        names = sorted(k for k in scope if type(k) is str and k not in reserved and not k.startswith("_"))
        if "final_answer" in names:  # the answer is checked first, so other variables cannot crowd it out
            names.remove("final_answer")
            names.insert(0, "final_answer")
        for name in names:
            mark = budget.left
            try:
                variables.append([name, wire.encode_value(scope[name], budget, run.patch_box)])
            except (wire.WireError, RecursionError, MemoryError) as err:
                budget.left = mark
                if name == "final_answer":
                    return {"status": "violation", "error": f"sandbox violation: final_answer cannot be returned: "
                            f"{err}", "variables": {"$d": []}}
                dropped.append(name)
        return {"variables": {"$d": variables}, "dropped": dropped[:50]}


def main(fd: int, memory_limit_mb: int, output_chars: int, message_limit: int, restricted: bool = True) -> None:
    """Worker entry point (see :meth:`Sandbox._start`)."""
    sock = socket.socket(fileno=fd)
    sock.settimeout(None)
    channel = wire.Channel(sock, message_limit)
    sys.setrecursionlimit(400)
    report = isolation.lock_down(memory_limit_mb, channel_fds=(fd,))
    sequence = None

    def request(call: dict[str, Any]) -> dict[str, Any]:
        channel.send({**call, "seq": sequence})
        return channel.receive()

    worker = Worker(request, output_chars, restricted)
    channel.send({"op": "ready", "isolation": report})
    while True:
        try:
            message = channel.receive()
        except (EOFError, OSError, wire.WireError):
            return
        if message["op"] != "run":
            return
        sequence = message.get("seq")
        try:
            reply = worker.run(message)
        except MemoryError:
            reply = {"op": "done", "status": "memory",
                     "error": "MemoryError: the code exceeded the sandbox memory limit"}
        except BaseException as err:  # noqa: BLE001 (the protocol itself broke, e.g. the parent went away)
            reply = {"op": "done", "status": "error", "error": _describe(err)}
        try:
            channel.send({**reply, "seq": sequence})
        except (OSError, ValueError):
            return
