"""The child process that runs an export's chat template and native tokenizer parser for
:mod:`clova_train.tooluse.template_guard` (``python -m clova_train.sandbox.template_worker``).

It imports what it needs and reads the tokenizer file it is given (a probe's), then locks itself down with the
package's sandbox layers (:func:`clova_train.sandbox.isolation.lock_down`: no new file, process or thread, an address
space limit, an unprivileged user and a system-call allowlist where the platform has them) and a CPU-time limit for a
probe; then it reads one JSON request per line on stdin and writes one JSON reply per line on stdout (the first, ``{"ready": true}``, says it is locked down), until stdin
closes (its parent is gone):

* ``{"op": "probe", "template": str | null, "special": {...}, "conversations": [[...], ...], "texts": [...],
  "max_chars": n}``: parse the tokenizer file (read at start) with the ``tokenizers`` library and encode ``texts``,
  then render ``template`` for the first of ``conversations`` it does not refuse (``raise_exception``: some
  templates refuse a system message, say); any other failure, or a refusal of all, fails the probe. Before each step it writes ``{"stage": "tokenizer" | "template"}``, so
  that a parent whose child dies (a Rust abort, the memory limit) knows which file did it.
* ``{"op": "render", "template": str, "special": {...}, "messages": [...], "add_generation_prompt": bool,
  "max_chars": n, "encode": bool}``: the rendered text (``{"ok": true, "text": ...}``), and its token ids
  (``"ids"``, without special tokens added) when ``encode`` is set.
* ``{"op": "encode", "texts": [...]}``: each text's token ids (``{"ok": true, "ids": [[...], ...]}``), without
  special tokens added, as ``tokenizer(text, add_special_tokens=False)`` gives them.
* ``{"op": "decode", "ids": [[...], ...], "skip_special_tokens": bool}``: each row's text from the tokenizer's
  decoder (``{"ok": true, "texts": [...]}``; transformers' clean-up of spaces, plain Python, is the parent's).

``encode`` and ``decode`` use the tokenizer the child was started with: a probe's file (path as the third argument),
or, when that argument is ``-``, the serialized tokenizer (``{"tokenizer": <tokenizer.json text>}``) of the first
line on stdin, read before the lock-down and parsed after it, on first use. So a pre-tokenizer, normaliser or
decoder regex that backtracks on some client's text, or a native panic, costs one request its answer, never the
server its event loop or its process.

Any failure is ``{"ok": false, "error": "<type>: <message>"}``; a panic of the Rust tokenizer is one too.
Rendering is transformers' own (``render_jinja_template``: a Jinja ``ImmutableSandboxedEnvironment``), so the text
is what ``apply_chat_template(..., tokenize=False)`` gives.
"""

from __future__ import annotations

import json
import sys
from typing import Any

def _limit(memory_mb: int, cpu_s: int) -> None:
    """Lock this process down before it parses anything from the export (``memory_mb``: address space it may add)."""
    from clova_train.sandbox.isolation import limit_cpu, lock_down

    lock_down(memory_mb, channel_fds=(0, 1, 2))
    if cpu_s > 0:
        limit_cpu(cpu_s)


def _send(reply: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(reply, ensure_ascii=True) + "\n")
    sys.stdout.flush()


def _failure(err: BaseException) -> dict[str, Any]:
    message = " ".join(str(err).split())[:500] or "no message"
    return {"ok": False, "error": f"{type(err).__name__}: {message}"}


def render(template: str, special: dict[str, Any], messages: list[dict[str, Any]], add_generation_prompt: bool,
           max_chars: int) -> str:
    """``template`` rendered for ``messages`` as transformers renders a chat template; a text longer than
    ``max_chars`` is an error."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], chat_template=template,
                                        add_generation_prompt=add_generation_prompt, **special)
    text = rendered[0]
    if not isinstance(text, str):
        raise TypeError(f"the template rendered a {type(text).__name__}, not text")
    if len(text) > max_chars:
        raise ValueError(f"the rendered text is {len(text):,} characters, more than the {max_chars:,} allowed")
    return text


def probe(request: dict[str, Any], tokenizer_text: str | None) -> dict[str, Any]:
    """Parse and exercise the tokenizer file, then render the template once (see the module docstring)."""
    tokens = 0
    if tokenizer_text is not None:
        _send({"stage": "tokenizer"})
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_str(tokenizer_text)
        for text in request.get("texts", []):
            tokens += len(tokenizer.encode(text).ids)
    chars = 0
    if request.get("template") is not None:
        _send({"stage": "template"})
        from jinja2.exceptions import TemplateError, TemplateSyntaxError

        conversations = request["conversations"]
        for number, messages in enumerate(conversations, 1):
            try:
                chars = len(render(request["template"], request.get("special", {}), messages, True,
                                   int(request["max_chars"])))
                break
            except TemplateError as err:  # the template's own refusal of this conversation (raise_exception)
                if isinstance(err, TemplateSyntaxError) or type(err) is not TemplateError or number == len(conversations):
                    raise
    return {"ok": True, "tokens": tokens, "chars": chars}


class _Codec:
    """The tokenizer of ``encode`` and ``decode`` requests, parsed from its JSON text on first use."""

    def __init__(self, text: str | None) -> None:
        self.text, self._tokenizer = text, None

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            if self.text is None:
                raise ValueError("this worker was started without a tokenizer")
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_str(self.text)
        return self._tokenizer

    def encode(self, texts: list[str]) -> list[list[int]]:
        tokenizer = self.tokenizer()  # one text at a time: encode_batch would start threads, which are refused
        return [list(tokenizer.encode(str(text), add_special_tokens=False).ids) for text in texts]

    def decode(self, rows: list[list[int]], skip_special_tokens: bool) -> list[str]:
        tokenizer = self.tokenizer()
        return [tokenizer.decode([int(i) for i in row], skip_special_tokens=skip_special_tokens) for row in rows]


def answer(request: dict[str, Any], codec: _Codec) -> dict[str, Any]:
    """The reply to one request (see the module docstring)."""
    op = request["op"]
    if op == "probe":
        return probe(request, codec.text)
    if op == "encode":
        return {"ok": True, "ids": codec.encode(list(request["texts"]))}
    if op == "decode":
        return {"ok": True, "texts": codec.decode(list(request["ids"]), bool(request.get("skip_special_tokens")))}
    text = render(request["template"], request.get("special", {}), request["messages"],
                  bool(request.get("add_generation_prompt")), int(request["max_chars"]))
    if request.get("encode"):
        return {"ok": True, "text": text, "ids": codec.encode([text])[0]}
    return {"ok": True, "text": text}


def serve(stdin: Any, tokenizer_text: str | None = None) -> None:
    """Answer requests until stdin closes."""
    codec = _Codec(tokenizer_text)
    for line in stdin:
        try:
            reply = answer(json.loads(line), codec)
        except BaseException as err:  # noqa: BLE001 (a Rust panic is a BaseException; each is one reply)
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            reply = _failure(err)
        try:
            _send(reply)
        except MemoryError:
            _send({"ok": False, "error": "MemoryError: the reply does not fit the worker's memory limit"})


WARM_UP = [  # rendered before the lock-down, so that what Jinja imports lazily is imported (no file opens after)
    "{% set ns = namespace(n=0) %}{% macro m(x) %}{{ x|tojson }}{% endmacro %}{% for message in messages %}"
    "{{ m(message) }}{{ message['content']|trim|upper|length }}{% set ns.n = ns.n + 1 %}{% endfor %}"
    "{{ bos_token }}{{ 'a' ~ 1 }}{{ [1, 2]|join(',') }}{{ {'a': 1}|items|list }}{% if add_generation_prompt %}x{% endif %}",
    "{{ raise_exception('warm-up') }}",
    "{% if %}",
    "{{ ''.__class__ }}{{ messages.append(1) }}",
    "{{ undefined_name.attribute }}",
]


def _warm_up() -> None:
    for template in WARM_UP:
        try:
            render(template, {"bos_token": "<s>"}, [{"role": "user", "content": "hi"}], True, 1 << 20)
        except Exception:  # noqa: BLE001 (the failures are the point: their code paths get imported)
            pass


def main(argv: list[str]) -> None:
    memory_mb, cpu_s = int(argv[0]), int(argv[1])
    import tokenizers  # noqa: F401 (imported before the lock-down: the package's own code, not the export's)
    from transformers.utils import chat_template_utils  # noqa: F401

    import jinja2.debug  # noqa: F401
    import jinja2.ext  # noqa: F401

    _warm_up()
    tokenizer_text = None
    if len(argv) > 2:  # read now: once locked down, no file can be opened
        from clova_train.core.errors import DataError
        from clova_train.core.safe_files import read_text
        from clova_train.core.model_file_limits import FILE_BYTES

        limit = FILE_BYTES["tokenizer.json"]
        try:
            if argv[2] == "-":
                line = sys.stdin.readline(limit + 64)
                if not line.endswith("\n"):
                    raise DataError(f"the serialized tokenizer is more than {limit:,} characters")
                tokenizer_text = str(json.loads(line)["tokenizer"])
            else:
                tokenizer_text = read_text(argv[2], "tokenizer file", limit)
        except (DataError, ValueError, KeyError) as err:
            _send({"stage": "tokenizer"})
            _send(_failure(err))
            return
    sys.setrecursionlimit(2000)
    _limit(memory_mb, cpu_s)
    _send({"ready": True})
    serve(sys.stdin, tokenizer_text)


if __name__ == "__main__":
    main(sys.argv[1:])
