"""Running an export's chat template and tokenizer parser where a hostile one cannot hang or crash the caller.

A chat template is a program (Jinja) that came with the export: it can loop for hours (nested ``range`` loops),
build a string of gigabytes, recurse, raise, or try to reach Python internals (the Jinja sandbox refuses that). A
``tokenizer.json`` is read by a native parser (Rust ``tokenizers`` and its regex engines), which can panic or abort
the whole process. So:

* :func:`probe_tokenizer_files` loads the tokenizer file and encodes probe texts, then renders the chat template
  once for a probe conversation, in a child process (:mod:`~clova_train.sandbox.template_worker`) locked down with
  the sandbox's layers (no file, process or thread; an address-space limit; a system-call allowlist), a CPU limit
  and a wall-clock timeout, before the caller loads either itself. A failure is one :class:`ExportError` naming
  the file at fault.
* :class:`ChatTemplateRenderer` renders each request's conversation in one long-lived child of the same kind, with
  a wall-clock timeout (the child is killed and started again on the next request) and a cap on the text's length;
  given the served tokenizer (its serialized ``tokenizer.json``), the same child encodes the prompt and any other
  text a request brings (stop strings) and decodes what the model wrote, so that a regex of the tokenizer that
  backtracks on one client's text costs that request its answer (an error after the timeout), not the server its
  other requests, and a native panic or abort only the child.

Cost (measured on this package's 2-core CPU machine, idle): a child starts in about 0.7 s (it imports
transformers' chat template code, warms Jinja up and locks itself down), so a probe takes about that; a render in
the long-lived child adds about 0.13 ms per request over rendering in-process (a pipe round trip; 0.17 ms against
0.04 ms for the training template).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clova_train.core.errors import DataError, ExportError


@dataclass(frozen=True)
class GuardLimits:
    """Bounds of the child that runs a chat template or tokenizer parser.

    Args:
        memory_mb: address space it may add once started (a real tokenizer.json of a 256k vocabulary takes well
            under 1 GB to parse).
        probe_timeout_s: wall-clock seconds for the probe (start, load the tokenizer, encode, render once); its CPU
            limit is the same number of seconds.
        render_timeout_s: wall-clock seconds for rendering one request's conversation.
        max_render_chars: the longest rendered prompt accepted beyond the conversation's own text (a template adds
            its frame: a few kilobytes for real ones).
    """

    memory_mb: int = 1536
    probe_timeout_s: float = 30.0
    render_timeout_s: float = 5.0
    max_render_chars: int = 1 << 20


DEFAULT_GUARD = GuardLimits()
STARTUP_S = 30.0  # how long a child may take to start (import, warm up, lock down: about 0.7 s on an idle machine)

# What the probe renders and encodes: a conversation of every role, and texts that make a badly written
# pre-tokenizer regex backtrack (long runs of one character class, mixed scripts, an unclosed quote).
PROBE_CONVERSATIONS = [  # tried in turn: a template may refuse one (raise_exception), not all
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is in the image? Use a tool if you need one."},
        {"role": "assistant", "content": "Thought: Do I need to use a tool? Yes\nAction: Detect\nObservation:"},
        {"role": "user", "content": "Describe it in one sentence, please."},
    ],
    [{"role": "user", "content": "What is in the image? Use a tool if you need one."}],
]
PROBE_TEXTS = [
    "Hello, world! It's 2024-05-01; the answer is 42.", "<s>" * 500, "日本語のテキスト" * 300, "\t \n" * 1000,
    "a " * 2000, "!?" * 2000,
    # a run of one character class, then one of another: where a nested quantifier backtracks
    *(run * 2000 + end for run in ("a", "A", "1", " ", "\n", "é", "'", ".", "🙂") for end in ("", "!", "b", " ")),
]


def _message_chars(messages: list[dict[str, Any]]) -> int:
    return sum(len(json.dumps(message, ensure_ascii=False)) for message in messages)


class _Worker:
    """One child running :mod:`~clova_train.sandbox.template_worker`, talked to one JSON line at a time."""

    def __init__(self, memory_mb: int, cpu_s: int, tokenizer_file: Path | None = None,
                 tokenizer_json: str | None = None) -> None:
        extra = [str(tokenizer_file)] if tokenizer_file is not None else ["-"] if tokenizer_json is not None else []
        self.process = subprocess.Popen(
            [sys.executable, "-m", "clova_train.sandbox.template_worker", str(memory_mb), str(cpu_s), *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0,
            start_new_session=True, close_fds=True, env=_child_environment(),
        )
        self._buffer = b""
        # the serialized tokenizer, the first line the child reads (sent with the first request)
        self._handshake = (json.dumps({"tokenizer": tokenizer_json}) + "\n").encode() if tokenizer_json else b""
        self.owner = os.getpid()  # a forked copy of this object must not talk to the same child
        self.ready = False  # it said it is locked down and reading requests
        self._finalizer = weakref.finalize(self, _kill, self.process)

    def ask(self, request: dict[str, Any], timeout_s: float, max_reply_bytes: int) -> tuple[dict[str, Any] | None, str]:
        """The child's final reply to ``request`` and the last stage it reported; ``None`` as the reply when it died
        or ran past ``timeout_s`` (counted from when it is ready: its start may take :data:`STARTUP_S` more; then it
        is killed)."""
        assert self.process.stdin is not None and self.process.stdout is not None
        deadline = time.monotonic() + timeout_s + (0.0 if self.ready else STARTUP_S)
        stage = ""
        try:
            data = memoryview(self._handshake + (json.dumps(request, ensure_ascii=True) + "\n").encode())
            self._handshake = b""
            while data:  # a pipe may take a long line in parts
                data = data[self.process.stdin.write(data) or 0:]
        except (BrokenPipeError, OSError):
            self.close()
            return None, stage
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            while True:
                while b"\n" in self._buffer:
                    line, self._buffer = self._buffer.split(b"\n", 1)
                    reply = json.loads(line)
                    if "ready" in reply:
                        self.ready = True
                        deadline = time.monotonic() + timeout_s
                        continue
                    if "stage" in reply:
                        stage = str(reply["stage"])
                        continue
                    return reply, stage
                left = deadline - time.monotonic()
                if left <= 0 or len(self._buffer) > max_reply_bytes:
                    self.close()
                    return None, stage
                if not selector.select(left):
                    continue
                chunk = os.read(self.process.stdout.fileno(), 1 << 20)
                if not chunk:  # the child is gone
                    self.close()
                    return None, stage
                self._buffer += chunk

    def ended(self) -> str:
        """How the child ended, in words (after :meth:`ask` gave no reply)."""
        code = self.process.poll()
        if code is None or code == -signal.SIGKILL:
            return "was stopped"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"

    def alive(self) -> bool:
        """The child still runs."""
        return self.process.poll() is None

    def close(self) -> None:
        self._finalizer()


def _child_environment() -> dict[str, str]:
    """A small environment for the child: nothing of the parent's beyond what starting Python needs."""
    kept = {name: os.environ[name] for name in ("PATH", "PYTHONPATH", "SYSTEMROOT") if name in os.environ}
    return {**kept, "LANG": "C.UTF-8", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            process.kill()
    process.wait()
    for stream in (process.stdin, process.stdout):
        if stream is not None:
            stream.close()


def _why(worker: _Worker, timeout_s: float, memory_mb: int) -> str:
    code = worker.process.poll()
    if code is None or code == -signal.SIGKILL:
        return f"did not finish within {timeout_s:g} s (a loop that does not end?)"
    if code == -signal.SIGXCPU:
        return f"used more than {timeout_s:g} s of CPU time (a loop that does not end?)"
    return f"crashed: its process {worker.ended()} (memory limit {memory_mb:,} MB)"


def probe_tokenizer_files(tokenizer_file: Path | None, template: str | None, special: dict[str, Any], where: str,
                          limits: GuardLimits | None = None) -> None:
    """Load ``tokenizer_file`` (a ``tokenizer.json``) and encode :data:`PROBE_TEXTS`, then render ``template`` for
    :data:`PROBE_CONVERSATIONS`, in a limited child; an :class:`ExportError` naming the tokenizer file or the chat
    template of ``where`` when either fails, hangs or crashes."""
    if tokenizer_file is None and template is None:
        return
    limits = limits or DEFAULT_GUARD
    worker = _Worker(limits.memory_mb, int(limits.probe_timeout_s) + 1, tokenizer_file)
    try:
        request = {"op": "probe", "template": template, "special": special, "conversations": PROBE_CONVERSATIONS,
                   "texts": PROBE_TEXTS, "max_chars": limits.max_render_chars + _message_chars(PROBE_CONVERSATIONS[0])}
        reply, stage = worker.ask(request, limits.probe_timeout_s, 1 << 20)
        culprit = (f"the tokenizer file {tokenizer_file}" if stage == "tokenizer"
                   else f"the chat template of {where}" if stage == "template" else f"the tokenizer files of {where}")
        if reply is None:
            raise ExportError(f"{culprit} cannot be used: loading it {_why(worker, limits.probe_timeout_s, limits.memory_mb)}")
        if not reply.get("ok"):
            action = "loading it" if stage == "tokenizer" else "rendering a probe conversation"
            raise ExportError(f"{culprit} cannot be used: {action} failed with {reply.get('error')}")
    finally:
        worker.close()


class ChatTemplateRenderer:
    """Renders conversations with a chat template, and encodes and decodes with the served tokenizer, in a long-lived
    limited child (see the module docstring).

    Args:
        template: the Jinja chat template (None: the child only encodes and decodes).
        special: the tokenizer's special tokens (``bos_token``, ``eos_token``, ...), as the template sees them.
        where: what the template came from, for messages.
        limits: the child's bounds (None: :data:`DEFAULT_GUARD`).
        tokenizer_json: the served tokenizer, serialized (``tokenizer.backend_tokenizer.to_str()``); None: this
            renderer does not encode or decode (:meth:`encodes` is False).
    """

    def __init__(self, template: str | None, special: dict[str, Any], where: str, limits: GuardLimits | None = None,
                 tokenizer_json: str | None = None) -> None:
        self.template, self.special, self.where = template, dict(special), where
        self.limits = limits or DEFAULT_GUARD
        self.tokenizer_json = tokenizer_json
        self._worker: _Worker | None = None
        self._lock = threading.Lock()

    @property
    def encodes(self) -> bool:
        """It holds the served tokenizer: :meth:`encode` and :meth:`decode` work."""
        return self.tokenizer_json is not None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages``; a :class:`DataError` when the template refuses them (its
        ``raise_exception``: roles out of order, say: the client's error), an :class:`ExportError` when it fails
        otherwise, runs past the timeout, runs out of memory or writes more than the conversation plus
        ``max_render_chars``."""
        return str(self._render(messages, add_generation_prompt, False)["text"])

    def render_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """The token ids of :meth:`render`'s text (no special tokens added: the template writes its own), rendered
        and encoded in one round trip; errors as :meth:`render`'s, and an :class:`ExportError` when encoding fails."""
        return [int(i) for i in self._render(messages, add_generation_prompt, True)["ids"]]

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Each text's token ids, as ``tokenizer(text, add_special_tokens=False)`` gives them; an
        :class:`ExportError` naming the tokenizer when it fails, panics or runs past the render timeout."""
        chars = sum(len(text) for text in texts)
        reply = self._ask({"op": "encode", "texts": list(texts)}, 24 * chars + (1 << 16), "encode this text")
        return [[int(i) for i in row] for row in reply["ids"]]

    def decode(self, rows: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        """Each row's text from the tokenizer's decoder (before transformers' clean-up of spaces); errors as
        :meth:`encode`'s."""
        ids = sum(len(row) for row in rows)
        reply = self._ask({"op": "decode", "ids": [list(map(int, row)) for row in rows],
                           "skip_special_tokens": skip_special_tokens},
                          2048 * ids + (1 << 16), "decode these tokens")
        return [str(text) for text in reply["texts"]]

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, encode: bool) -> dict[str, Any]:
        if self.template is None:
            raise ExportError(f"the tokenizer of {self.where} has no chat template")
        if encode and not self.encodes:
            raise ExportError(f"the renderer of {self.where} was given no tokenizer to encode with")
        max_chars = self.limits.max_render_chars + _message_chars(messages)
        request = {"op": "render", "template": self.template, "special": self.special, "messages": messages,
                   "add_generation_prompt": add_generation_prompt, "max_chars": max_chars, "encode": encode}
        with self._lock:
            worker = self._started()
            reply, _ = worker.ask(request, self.limits.render_timeout_s, 36 * max_chars + (1 << 16))
        if reply is None:
            raise ExportError(f"the chat template of {self.where} cannot render this conversation: it "
                              f"{_why(worker, self.limits.render_timeout_s, self.limits.memory_mb)}")
        if not reply.get("ok"):
            error = str(reply.get("error"))
            if error.startswith("TemplateError: "):  # the template refuses this conversation (raise_exception)
                raise DataError(f"the model's chat template refuses this conversation: {error.removeprefix('TemplateError: ')}")
            raise ExportError(f"the chat template of {self.where} cannot render this conversation: {error}")
        return reply

    def _ask(self, request: dict[str, Any], max_reply_bytes: int, action: str) -> dict[str, Any]:
        if not self.encodes:
            raise ExportError(f"the renderer of {self.where} was given no tokenizer to {action} with")
        with self._lock:
            worker = self._started()
            reply, _ = worker.ask(request, self.limits.render_timeout_s, max_reply_bytes)
        if reply is None:
            raise ExportError(f"the tokenizer of {self.where} cannot {action}: it "
                              f"{_why(worker, self.limits.render_timeout_s, self.limits.memory_mb)}")
        if not reply.get("ok"):
            raise ExportError(f"the tokenizer of {self.where} cannot {action}: {reply.get('error')}")
        return reply

    def _started(self) -> _Worker:
        """The child, started again when it died, was killed or belongs to another process (a fork)."""
        if self._worker is None or self._worker.owner != os.getpid() or not self._worker.alive():
            self._worker = _Worker(self.limits.memory_mb, 0, tokenizer_json=self.tokenizer_json)
        return self._worker

    def close(self) -> None:
        """Stop the child (it also ends with this process: its stdin closes)."""
        with self._lock:
            if self._worker is not None:
                self._worker.close()
                self._worker = None

    def __getstate__(self) -> dict[str, Any]:  # handed to server workers: each starts its own child
        return {"template": self.template, "special": self.special, "where": self.where, "limits": self.limits,
                "tokenizer_json": self.tokenizer_json}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]


def _token_text(value: Any) -> Any:
    """A special token as a template sees it: the text of an ``AddedToken`` object as saved in JSON."""
    return value.get("content") if isinstance(value, dict) else value


def template_and_special_tokens(directory: Path) -> tuple[str | None, dict[str, Any]]:
    """The chat template a tokenizer in ``directory`` loads (``chat_template.jinja``, else ``tokenizer_config.json``'s
    ``chat_template``, the ``default`` one of named templates) and its special tokens, read with the bounded
    readers (:func:`clova_train.core.model_file_limits.check_model_files` has bounded their sizes)."""
    from clova_train.core.safe_files import read_json_object, read_text
    from clova_train.core.model_file_limits import MAX_TEMPLATE_CHARS

    config_file = directory / "tokenizer_config.json"
    config = read_json_object(config_file, "tokenizer config") if config_file.is_file() else {}
    special = {name: _token_text(config[name]) for name in ("bos_token", "eos_token", "unk_token", "pad_token")
               if isinstance(_token_text(config.get(name)), str)}
    template: Any = None
    if (directory / "chat_template.jinja").is_file():
        template = read_text(directory / "chat_template.jinja", "chat template", MAX_TEMPLATE_CHARS)
    else:
        template = config.get("chat_template")
        if isinstance(template, list):
            named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
            template = named.get("default", next(iter(named.values()), None))
    return (template if isinstance(template, str) else None), special


_PROBED: set[tuple[Any, ...]] = set()  # tokenizer directories that passed, by their files' identity and times


def _identity(directory: Path) -> tuple[Any, ...]:
    stats = []
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        try:
            stat = (directory / name).stat()
            stats.append((name, stat.st_ino, stat.st_size, stat.st_mtime_ns))
        except OSError:
            stats.append((name, None))
    return (str(directory.resolve()), *stats)


def probe_tokenizer_directory(directory: Path, limits: GuardLimits | None = None) -> None:
    """:func:`probe_tokenizer_files` for the tokenizer saved in ``directory`` (its ``tokenizer.json`` and chat
    template); once per process for files that have not changed since."""
    limits = limits or DEFAULT_GUARD
    identity = (_identity(directory), limits)
    if identity in _PROBED:
        return
    template, special = template_and_special_tokens(directory)
    tokenizer_file = directory / "tokenizer.json"
    probe_tokenizer_files(tokenizer_file if tokenizer_file.is_file() else None, template, special, str(directory),
                          limits)
    _PROBED.add(identity)


@contextmanager
def guarded_tokenizer(tokenizer: Any) -> Iterator[None]:
    """Encoding with a tokenizer whose native code panics (a ``PanicException`` of the Rust ``tokenizers``: not an
    ``Exception``) is one :class:`ExportError` naming the tokenizer."""
    try:
        yield
    except BaseException as err:
        if type(err).__name__ != "PanicException":
            raise
        where = getattr(tokenizer, "name_or_path", "") or "the export"
        cause = " ".join(str(err).split())[:300]
        raise ExportError(f"the tokenizer of {where} failed on this text (its native code panicked: {cause})") from None
