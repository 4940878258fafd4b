"""The VQA record format (JSON list or JSONL), read and checked without Lightning.

A record is ``{"image", "question", "answer"}`` with optional ``"id"``, ``"val_question"``, ``"val_answer"``
and ``"correct"`` (see ``clova_train.datamodules.prompt_tuning.vqa_records``). The datamodule and the serving demo both
read records here; every error names the file and the record.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from clova_train.core.errors import DataError
from clova_train.core.safe_files import parse_json, read_text

REQUIRED = ("image", "question", "answer")
OPTIONAL = ("id", "val_question", "val_answer", "correct")


def read_records(path: Path, required: tuple[str, ...] = REQUIRED) -> list[dict[str, Any]]:
    """Records of a JSON list or JSONL file, each checked; errors name the file and the record number."""
    text = read_text(path, "VQA records file")
    if not text.strip():
        raise DataError(f"VQA records file {path} is empty")
    records: list[tuple[str, Any]] = []
    whole: Any = None
    if text.lstrip().startswith("["):
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None  # not one JSON document: read it as JSON lines
        except RecursionError:
            whole = parse_json(text, f"VQA records file {path}")  # names the nesting
        else:
            whole = parse_json(text, f"VQA records file {path}")  # depth and duplicate keys
    if isinstance(whole, list) and (not whole or any(isinstance(item, dict) for item in whole)):
        records = [(f"record {i + 1}", item) for i, item in enumerate(whole)]
    else:
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append((f"line {number}", parse_json(line, "the line")))
            except DataError as err:
                raise DataError(f"{path}, line {number}: not valid JSON ({err})") from None
    if not records:
        raise DataError(f"VQA records file {path} holds no records")
    checked: list[dict[str, Any]] = []
    places_of_ids: dict[str, str] = {}
    for where, record in records:
        place = f"{path}, {where}"
        if not isinstance(record, dict):
            raise DataError(f"{place}: a record must be a JSON object, got {type(record).__name__}")
        for key in required:
            if key not in record:
                raise DataError(f"{place}: missing field {key!r}")
        for key in ("question", "answer", "val_question", "val_answer", "image", "id"):
            if key in record and (not isinstance(record[key], str) or not record[key].strip()):
                raise DataError(f"{place}: field {key!r} must be a non-empty string")
        if "correct" in record and not isinstance(record["correct"], bool):
            raise DataError(f"{place}: field 'correct' must be true or false")
        if "id" in record:
            if record["id"] in places_of_ids:
                raise DataError(f"{place}: id {record['id']!r} is already the id of {places_of_ids[record['id']]}; "
                                "each record needs its own")
            places_of_ids[record["id"]] = where
        checked.append({**record, "_where": place})
    return checked


def record_image(records_file: Path, image: str, image_root: Path | None = None) -> Path:
    """Where a record's image is: absolute, or relative to ``image_root`` (default: the records file's folder)."""
    path = Path(image)
    return path if path.is_absolute() else (image_root or records_file.parent) / path
