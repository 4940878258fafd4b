"""Answering a stream of JSON requests with an exported prompt tool: ``clova-train predict`` (a folder or a JSONL of
inputs, written to a JSONL file) and ``clova-train serve --stdin`` / ``--request`` (JSON lines in, JSON lines out).

Each input becomes one of the tool's JSON requests (the ones ``clova-train serve`` answers over HTTP): an image of a
folder fills the tool's image field and the ``--field NAME=VALUE`` options fill the rest; a JSONL line is a
request as it is. **A bad input never stops the stream**: a line that is not UTF-8, too long, not JSON, not an
object, a request the tool refuses, an image that cannot be read, an ``output`` outside the output folder, or a tool
that fails on it is reported on its own line and the next input is answered; the command exits non-zero at the end
when any input failed, after a count.

* ``predict``: the output is JSONL, one line per input in input order: ``{"input": request, "output": reply}``, or
  ``{"input": request, "error": message}`` when that input cannot be answered (JSONL inputs add ``"line": n``; a
  line that is not a request has ``"input": null``). The file is written atomically at the end.
* ``serve --stdin``: one JSON line on stdout per non-blank input line, in order: the reply, or
  ``{"error": {"message", "type", "param", "code", "line"}}`` (OpenAI's error shape, as the HTTP server answers,
  with the line number) in that line's place; each failure is also one ``request line N: message`` line on stderr.

Files a tool writes (REPLACE's ``output``) go under an output folder, as over HTTP
(:func:`~clova_train.serving.http.served_output_path`): the request's ``output`` must be a relative path that stays
inside it, symbolic links resolved; anything else is refused with one message, and the tool is not run.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from clova_train.core.atomic import write_text_atomic
from clova_train.core.errors import ClovaTrainError, DataError
from clova_train.core.safe_files import JSONSyntaxError, parse_json, printable, read_bytes
from clova_train.tools.images import IMAGE_SUFFIXES, display_path, list_images
from clova_train.tools.prompt_server import REQUEST_LIMITS, PromptToolServer, parse_request

OUTPUT_FIELD = "output"  # the request field naming a file the tool writes (REPLACE's edited image)
MAX_LINE_BYTES = REQUEST_LIMITS.max_bytes  # longest request line read; a longer one is reported and skipped
MAX_INPUT_FILE_BYTES = 1 << 30  # largest JSONL of requests predict reads
Serve = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class Answer:
    """The outcome of one input: its ``request`` (None when the line was not one), and the ``reply`` or the
    ``error`` message."""

    number: int
    request: dict[str, Any] | None
    reply: dict[str, Any] | None = None
    error: str | None = None


def confined_output(request: dict[str, Any], output_dir: Path) -> dict[str, Any]:
    """``request`` with its ``output`` (if any) placed under ``output_dir`` by the HTTP server's rule, or a
    :class:`DataError` saying why that name is refused."""
    if OUTPUT_FIELD not in request:
        return request
    from fastapi import HTTPException

    from clova_train.serving.http import served_output_path

    try:
        target = served_output_path(output_dir, request[OUTPUT_FIELD])
    except HTTPException as err:
        detail = str(err.detail).replace("the server's --output-dir", "the output folder")
        raise DataError(f"{detail} (output folder: {printable(output_dir)})") from None
    return {**request, OUTPUT_FIELD: str(target)}


def answer_request(serve: Serve, request: dict[str, Any], output_dir: Path) -> dict[str, Any]:
    """The reply to one request, its ``output`` confined to ``output_dir``; a failure of any kind is a
    :class:`DataError` (a tool's own bug is named by its type: the stream goes on)."""
    request = confined_output(request, output_dir)
    try:
        return serve(request)
    except ClovaTrainError:
        raise
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as err:  # the tool failed on this input only (a RuntimeError in a model, ...)
        raise DataError(f"the tool failed on this request: {type(err).__name__}: {str(err)[:500]}") from err


def answer_lines(serve: Serve, lines: Iterable[tuple[int, str | DataError]], output_dir: Path, where: str,
                 prepare: Callable[[dict[str, Any]], dict[str, Any]] = lambda r: r) -> Iterator[Answer]:
    """One :class:`Answer` per non-blank line, in order; a line that is no request, or one that fails, is an
    answer with an ``error`` naming ``where`` and the line, and the next line is answered all the same."""
    for number, line in lines:
        if isinstance(line, str) and not line.strip():
            continue
        request = None
        try:
            if isinstance(line, DataError):
                raise line
            request = prepare(parse_request(line, f"{where} {number}"))
            yield Answer(number, request, reply=answer_request(serve, request, output_dir))
        except ClovaTrainError as err:
            yield Answer(number, request, error=str(err))


def numbered_lines(stream: BinaryIO, where: str, max_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, str | DataError]]:
    """``(number, text)`` for each line of a binary stream, read one at a time (never more than ``max_bytes`` of
    a line held); a line too long or not UTF-8 comes as a :class:`DataError` in its place."""
    number = 0
    while line := stream.readline(max_bytes + 1):
        number += 1
        if len(line) > max_bytes and not line.endswith(b"\n"):
            while (rest := stream.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass  # the rest of the long line is read and dropped
            yield number, DataError(f"{where} {number} is longer than the {max_bytes:,} bytes accepted")
            continue
        try:
            yield number, line.decode("utf-8")
        except UnicodeDecodeError as err:
            yield number, DataError(f"{where} {number} is not UTF-8 text (byte {err.start}: "
                                    f"{line[err.start:err.start + 1]!r})")


def error_line(answer: Answer) -> dict[str, Any]:
    """A failed answer as ``serve --stdin`` writes it: OpenAI's error shape with the line number."""
    from clova_train.serving.guard import error_body

    body = error_body(400, answer.error or "")
    body["error"]["line"] = answer.number
    return body


def parse_fields(fields: list[str]) -> dict[str, Any]:
    """``NAME=VALUE`` options as request fields (JSON values where they parse, else the text)."""
    parsed: dict[str, Any] = {}
    for item in fields:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise DataError(f"--field {item!r} must be NAME=VALUE")
        try:
            parsed[name] = parse_json(value, f"--field {name}")
        except JSONSyntaxError:  # plain text; JSON that is too deep or repeats a key is still an error
            parsed[name] = value
    return parsed


def requests_from_folder(folder: Path, image_field: str, fields: dict[str, Any]) -> Iterator[dict[str, Any]]:
    images = list_images(folder)
    if not images:
        raise DataError(f"input folder {display_path(folder)} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    for path in images:
        yield {**fields, image_field: [str(path)] if image_field == "images" else str(path)}


def jsonl_lines(path: Path) -> Iterator[tuple[int, str | DataError]]:
    """The numbered lines of a JSONL file of requests (each decoded on its own: one bad line is that line's error)."""
    import io

    return numbered_lines(io.BytesIO(read_bytes(path, "request file", MAX_INPUT_FILE_BYTES)),
                          f"{display_path(path)} line")


def relative_paths(path: Path, path_fields: tuple[str, ...]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A request of the JSONL ``path`` with its relative file paths made relative to the file's folder (all but
    ``output``, which goes under the output folder)."""
    fields = tuple(f for f in path_fields if f != OUTPUT_FIELD)
    return lambda request: {k: _relative_to(path.parent, v) if k in fields else v for k, v in request.items()}


def _relative_to(folder: Path, value: Any) -> Any:
    if isinstance(value, str) and value and not Path(value).is_absolute():
        return str(folder / value)
    if isinstance(value, list):
        return [_relative_to(folder, v) for v in value]
    return value


def predict_to_file(
    export: str, inputs: str, output: str, fields: list[str], top_k: int | None = None, device: str = "cpu",
    base_model: str | None = None, output_dir: str | None = None,
) -> tuple[int, list[str]]:
    """Answer every input and write the JSONL; returns the lines written and the errors of the inputs that failed
    (each ``"input N: message"``, N the image's place or the JSONL line). Files the tool writes go under
    ``output_dir`` (default: the folder ``output`` is written in)."""
    source = Path(inputs)
    extra = parse_fields(fields)
    if not source.exists():
        raise DataError(f"inputs not found: {display_path(source)}")
    if not source.is_dir() and extra:
        raise DataError("--field applies to folder inputs; a JSONL line is a whole request")
    written_under = Path(output_dir) if output_dir is not None else Path(output).parent
    server = PromptToolServer.from_export(export, top_k=top_k, device=device, base_model=base_model)
    tool = type(server.tool)
    if source.is_dir():
        requests = list(requests_from_folder(source, tool.request_image_field, extra))
        answers: Iterable[Answer] = (
            _answer_one(server.serve, number, request, written_under)
            for number, request in enumerate(_progress(requests), 1))
        jsonl = False
    else:
        answers = answer_lines(server.serve, jsonl_lines(source), written_under, f"{display_path(source)} line",
                               relative_paths(source, tool.request_path_fields))
        jsonl = True
    lines, failed = [], []
    for answer in answers:
        line: dict[str, Any] = {"line": answer.number} if jsonl else {}
        line["input"] = answer.request
        if answer.error is None:
            line["output"] = answer.reply
        else:
            line["error"] = answer.error
            failed.append(f"{'line' if jsonl else 'input'} {answer.number}: {answer.error}")
        lines.append(line)
    write_text_atomic(output, "".join(json.dumps(line) + "\n" for line in lines))
    return len(lines), failed


def _answer_one(serve: Serve, number: int, request: dict[str, Any], output_dir: Path) -> Answer:
    try:
        return Answer(number, request, reply=answer_request(serve, request, output_dir))
    except ClovaTrainError as err:
        return Answer(number, request, error=str(err))


def _progress(items: list[dict[str, Any]]) -> Any:
    from clova_train.core.progress import progress_over

    return progress_over(items, "predict", "input", disable=len(items) < 2)
