"""``clova-train predict``: an exported prompt tool with its prompt pool over a folder or a JSONL of inputs.

Each input becomes one of the tool's JSON requests (the ones ``clova-train serve`` answers): an image of a
folder fills the tool's image field and the ``--field NAME=VALUE`` options fill the rest; a JSONL line is a
request as it is. The output is JSONL, one line per input in input order: ``{"input": request, "output":
reply}``, or ``{"input": request, "error": message}`` when that input cannot be answered (the others still
are). The file is written atomically at the end.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from clova_train.core.atomic import write_text_atomic
from clova_train.core.errors import ClovaTrainError, DataError
from clova_train.core.safe_files import JSONSyntaxError, parse_json, read_text
from clova_train.tools.images import IMAGE_SUFFIXES, display_path, list_images
from clova_train.tools.prompt_server import PromptToolServer, parse_request


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


def requests_from_jsonl(path: Path, path_fields: tuple[str, ...]) -> Iterator[dict[str, Any]]:
    lines = read_text(path, "request file").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        request = parse_request(line, f"{display_path(path)} line {number}")
        yield {k: _relative_to(path.parent, v) if k in path_fields else v for k, v in request.items()}


def _relative_to(folder: Path, value: Any) -> Any:
    if isinstance(value, str) and value and not Path(value).is_absolute():
        return str(folder / value)
    if isinstance(value, list):
        return [_relative_to(folder, v) for v in value]
    return value


def predict_to_file(
    export: str, inputs: str, output: str, fields: list[str], top_k: int | None = None, device: str = "cpu",
    base_model: str | None = None,
) -> tuple[int, list[str]]:
    """Answer every input and write the JSONL; returns the lines written and the errors of the inputs that failed."""
    source = Path(inputs)
    extra = parse_fields(fields)
    if not source.exists():
        raise DataError(f"inputs not found: {display_path(source)}")
    server = PromptToolServer.from_export(export, top_k=top_k, device=device, base_model=base_model)
    tool = type(server.tool)
    if source.is_dir():
        requests = list(requests_from_folder(source, tool.request_image_field, extra))
    else:
        if extra:
            raise DataError("--field applies to folder inputs; a JSONL line is a whole request")
        requests = list(requests_from_jsonl(source, tool.request_path_fields))
    lines, failed = [], []
    for request in _progress(requests):
        try:
            lines.append({"input": request, "output": server.serve(request)})
        except ClovaTrainError as err:
            failed.append(str(err))
            lines.append({"input": request, "error": str(err)})
    write_text_atomic(output, "".join(json.dumps(line) + "\n" for line in lines))
    return len(lines), failed


def _progress(items: list[dict[str, Any]]) -> Any:
    from clova_train.core.progress import progress_over

    return progress_over(items, "predict", "input", disable=len(items) < 2)
