"""The child process that runs an export's chat template and native tokenizer parser for
:mod:`clova_train.tooluse.template_guard` (``python -m clova_train.tooluse.template_worker``).

It limits itself first (address space, and CPU time for a probe), then reads one JSON request per line on stdin and
writes one JSON reply per line on stdout, until stdin closes (its parent is gone):

* ``{"op": "probe", "tokenizer_file": path | null, "template": str | null, "special": {...}, "messages": [...],
  "texts": [...], "max_chars": n}``: load the tokenizer file with the ``tokenizers`` library and encode ``texts``,
  then render ``template`` for ``messages``. Before each step it writes ``{"stage": "tokenizer" | "template"}``, so
  that a parent whose child dies (a Rust abort, the memory limit) knows which file did it.
* ``{"op": "render", "template": str, "special": {...}, "messages": [...], "add_generation_prompt": bool,
  "max_chars": n}``: the rendered text (``{"ok": true, "text": ...}``).

Any failure is ``{"ok": false, "error": "<type>: <message>"}``; a panic of the Rust tokenizer is one too.
Rendering is transformers' own (``render_jinja_template``: a Jinja ``ImmutableSandboxedEnvironment``), so the text
is what ``apply_chat_template(..., tokenize=False)`` gives.
"""

from __future__ import annotations

import json
import resource
import sys
from typing import Any

def _limit(memory_mb: int, cpu_s: int) -> None:
    """Bound this process before it reads anything from the export."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    if cpu_s > 0:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


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


def probe(request: dict[str, Any]) -> dict[str, Any]:
    """Load and exercise the tokenizer file, then render the template once (see the module docstring)."""
    tokens = 0
    if request.get("tokenizer_file"):
        _send({"stage": "tokenizer"})
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(request["tokenizer_file"])
        for text in request.get("texts", []):
            tokens += len(tokenizer.encode(text).ids)
    chars = 0
    if request.get("template") is not None:
        _send({"stage": "template"})
        chars = len(render(request["template"], request.get("special", {}), request["messages"], True,
                           int(request["max_chars"])))
    return {"ok": True, "tokens": tokens, "chars": chars}


def serve(stdin: Any) -> None:
    """Answer requests until stdin closes."""
    for line in stdin:
        try:
            request = json.loads(line)
            if request["op"] == "probe":
                reply = probe(request)
            else:
                reply = {"ok": True, "text": render(request["template"], request.get("special", {}),
                                                    request["messages"], bool(request.get("add_generation_prompt")),
                                                    int(request["max_chars"]))}
        except BaseException as err:  # noqa: BLE001 (a Rust panic is a BaseException; each is one reply)
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            reply = _failure(err)
        try:
            _send(reply)
        except MemoryError:
            _send({"ok": False, "error": "MemoryError: the reply does not fit the worker's memory limit"})


def main(argv: list[str]) -> None:
    memory_mb, cpu_s = int(argv[0]), int(argv[1])
    import tokenizers  # noqa: F401 (imported before the limits: the package's own code, not the export's)
    from transformers.utils import chat_template_utils  # noqa: F401

    sys.setrecursionlimit(2000)
    _limit(memory_mb, cpu_s)
    serve(sys.stdin)


if __name__ == "__main__":
    main(sys.argv[1:])
