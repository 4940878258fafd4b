"""What a run directory holds, read for the report: its kind, its logged metrics and its result files.

A prompt-tuning run has ``summary.json`` (every instance's gate verdict and learning curve) and, after
``validate``/``test``, ``evaluation/<stage>.json``; a LoRA run has ``adapter/``; a controller run has
``logs/progress.csv`` (stable-baselines3's CSV log) and ``evaluation.json``. Lightning's CSV logger writes
``metrics.csv`` under the run.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clova_train.core.errors import DataError
from clova_train.core.safe_files import ReadLimits, printable, read_json_object, read_text
from clova_train.core.run_manifest import SUMMARY_FILE, read_run_manifest

KINDS = ("prompt_tuning", "lora", "controller")

# What the files of a run can hold. A log: a row per logged step of a few hundred metrics (a million-step run logging
# every step is about 100 MB). A summary: a record per instance with its loss at every inner step (60,000 LVIS
# instances of 100 steps are about 60 MB). An evaluation: a row per concept of a few columns.
MAX_LOG_BYTES = 512 << 20
MAX_LOG_COLUMNS = 10_000
MAX_LOG_ROWS = 10_000_000
MAX_LOG_VALUES = 5_000_000  # numbers kept over all columns (a million steps of 5 metrics; Lightning logs every 50th)
MAX_LOG_CELLS = 50_000_000  # cells read, empty ones too (a sparse log of 10,000 columns is mostly commas)
SUMMARY_LIMITS = ReadLimits(max_bytes=128 << 20, max_depth=8, max_values=10_000_000, max_text=100_000)
EVALUATION_LIMITS = ReadLimits(max_bytes=64 << 20, max_depth=8, max_values=5_000_000, max_text=10_000)
MAX_INSTANCES = 2_000_000
MAX_CURVE_STEPS = 1_000_000
MAX_NAME_CHARS = 1_000  # a concept, a policy, a rejection kind


@dataclass
class Series:
    """One logged metric: its x values (step or timesteps) and y values, in log order."""

    x: list[float] = field(default_factory=list)
    y: list[float] = field(default_factory=list)


@dataclass
class Run:
    """What the report reads from a run directory."""

    directory: Path
    kind: str
    metrics: dict[str, Series]
    summary: dict[str, Any] | None = None
    evaluations: dict[str, dict[str, Any]] = field(default_factory=dict)


def run_kind(directory: Path) -> str:
    """``lora``, ``controller`` or ``prompt_tuning`` (what this report draws), from the directory's manifest."""
    kind = read_run_manifest(directory).kind
    if kind not in ("lora", "controller", "prompt_tuning"):
        raise DataError(f"{directory} holds a {kind} run, which this report does not draw: give the run directory "
                        "of a prompt-tuning, LoRA or controller run")
    return kind


def read_series(path: Path, x_columns: tuple[str, ...]) -> dict[str, Series]:
    """Every numeric column of a CSV log as a series against the first of ``x_columns`` the row has; a log that is
    not a regular file, or holds more than :data:`MAX_LOG_BYTES`, columns, rows, cells or numbers than a real log does, is one
    :class:`DataError` naming it."""
    where = f"the log {printable(path)}"
    text = read_text(path, "log", MAX_LOG_BYTES)
    series: dict[str, Series] = {}
    cells = values = 0
    try:
        reader = csv.reader(_lines(text))
        header = next(reader, [])
        if len(header) > MAX_LOG_COLUMNS:
            raise DataError(f"{where} has {len(header):,} columns, more than the {MAX_LOG_COLUMNS:,} a log holds")
        last = {name: i for i, name in enumerate(header)}  # a repeated column name: its last column, as DictReader
        x_at = [last[c] for c in x_columns if c in last]
        names = [name if name and name not in x_columns and last[name] == i else None for i, name in enumerate(header)]
        for number, row in enumerate(reader, 1):
            cells += len(row)
            if number > MAX_LOG_ROWS or cells > MAX_LOG_CELLS:
                raise DataError(f"{where} has more than {MAX_LOG_ROWS:,} rows or {MAX_LOG_CELLS:,} cells")
            x = next((_number(row[i]) for i in x_at if i < len(row) and _number(row[i]) is not None), None)
            if x is None:
                continue
            for name, value in zip(names, row):
                if value and name is not None:  # the empty cells of a sparse log cost one test each
                    y = _number(value)
                    if y is not None:
                        series.setdefault(name, Series()).x.append(x)
                        series[name].y.append(y)
                        values += 1
            if values > MAX_LOG_VALUES:  # within the bytes, columns and rows, a dense log still fills gigabytes
                raise DataError(f"{where} holds more than {MAX_LOG_VALUES:,} numbers, more than a log holds")
    except csv.Error as err:
        raise DataError(f"cannot read {where}: {err}") from None
    return series


def _lines(text: str) -> Iterator[str]:
    """The lines of ``text`` with their ends, one at a time (a StringIO would copy a 512 MB log at four bytes a
    character)."""
    start = 0
    while start < len(text):
        end = text.find("\n", start) + 1 or len(text)
        yield text[start:end]
        start = end


def _number(value: Any) -> float | None:
    if not isinstance(value, str) or len(value) > 100:  # a cell of a 100,000-digit number is not a metric
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def csv_logs(directory: Path) -> list[Path]:
    """Every ``metrics.csv`` Lightning's CSV logger wrote under the run (one ``version_N`` per fit, resume,
    validate or test), oldest first; exports and reports are not searched."""
    found = [p for p in directory.rglob("metrics.csv")
             if not {"export", "report"} & set(p.relative_to(directory).parts[:-1])]
    return sorted(found, key=lambda p: p.lstat().st_mtime)  # lstat: a dangling link is refused when read


def merged_series(logs: list[Path]) -> dict[str, Series]:
    """The series of several logs together, ordered by step (a later log's point at the same step wins)."""
    points: dict[str, dict[float, float]] = {}
    for log in logs:
        for name, series in read_series(log, ("step",)).items():
            points.setdefault(name, {}).update(zip(series.x, series.y))
    return {name: Series(sorted(values), [values[x] for x in sorted(values)]) for name, values in points.items()}


def read_run(directory: Path) -> Run:
    """The run in ``directory``, or a :class:`DataError` naming what is missing."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DataError(f"run directory not found: {directory}")
    kind = run_kind(directory)
    if kind == "controller":
        progress = directory / "logs" / "progress.csv"
        metrics = read_series(progress, ("time/total_timesteps",)) if progress.exists() else {}
        evaluations = {}
        if (directory / "evaluation.json").exists():
            table = read_policy_evaluation(directory / "evaluation.json")
            evaluations[split_label(table)] = table
        return Run(directory, kind, metrics, evaluations=evaluations)
    metrics = merged_series(csv_logs(directory))
    summary = read_summary(directory / SUMMARY_FILE) if (directory / SUMMARY_FILE).exists() else None
    evaluations = {path.stem: read_concept_evaluation(path)
                   for path in sorted((directory / "evaluation").glob("*.json"))}
    return Run(directory, kind, metrics, summary, evaluations)


def _name(value: Any, where: str) -> None:
    if value is not None and not (isinstance(value, (str, int, float)) and len(str(value)) <= MAX_NAME_CHARS):
        raise DataError(f"{where} must be a name of at most {MAX_NAME_CHARS:,} characters, got "
                        f"{type(value).__name__}")


def _not_infinite(value: Any, where: str) -> None:
    """A number (NaN allowed: an evaluation over no sample has no mean), never infinite, a bool or another type."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isinf(value):
        raise DataError(f"{where} = {str(value)[:40]}: must be a finite number (or NaN)")


def read_summary(path: Path) -> dict[str, Any]:
    """``summary.json`` with every field the report draws checked: ``instances`` a list of records, each with a
    boolean ``accepted``, a ``concept`` name (or null), a ``loss_curve`` of finite numbers, an integer ``steps`` and
    ``rejections`` with a text ``kind``."""
    summary = read_json_object(path, "run summary", SUMMARY_LIMITS)
    where = f"run summary {printable(path)}"
    instances = summary.get("instances", [])
    if not isinstance(instances, list) or len(instances) > MAX_INSTANCES:
        raise DataError(f"{where}: instances must be a list of at most {MAX_INSTANCES:,} records")
    for i, item in enumerate(instances):
        at = f"{where}: instances[{i}]"
        if not isinstance(item, dict):
            raise DataError(f"{at} must be an object, got {type(item).__name__}")
        if not isinstance(item.get("accepted"), bool):
            raise DataError(f"{at}.accepted must be true or false, got {str(item.get('accepted'))[:40]}")
        _name(item.get("concept"), f"{at}.concept")
        steps = item.get("steps", 1)
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps <= MAX_CURVE_STEPS:
            raise DataError(f"{at}.steps = {str(steps)[:40]}: must be an integer from 0 to {MAX_CURVE_STEPS:,}")
        curve = item.get("loss_curve", [])
        if not isinstance(curve, list) or len(curve) > MAX_CURVE_STEPS:
            raise DataError(f"{at}.loss_curve must be a list of at most {MAX_CURVE_STEPS:,} losses")
        for j, value in enumerate(curve):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise DataError(f"{at}.loss_curve[{j}] = {str(value)[:40]}: must be a finite number")
        rejections = item.get("rejections", [])
        if not isinstance(rejections, list) or not all(
                isinstance(r, dict) and isinstance(r.get("kind"), str) and len(r["kind"]) <= MAX_NAME_CHARS
                for r in rejections):
            raise DataError(f"{at}.rejections must be a list of objects with a text 'kind'")
    return summary


def read_concept_evaluation(path: Path) -> dict[str, Any]:
    """A prompt-tuning ``evaluation/<stage>.json``: ``per_concept`` rows whose columns hold a numeric ``mean`` and a
    two-number ``ci95``."""
    evaluation = read_json_object(path, "evaluation", EVALUATION_LIMITS)
    where = f"evaluation {printable(path)}"
    rows = evaluation.get("per_concept", [])
    if not isinstance(rows, list):
        raise DataError(f"{where}: per_concept must be a list")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{where}: per_concept[{i}] must be an object")
        _name(row.get("concept"), f"{where}: per_concept[{i}].concept")
        for key, value in row.items():
            if isinstance(value, dict) and "mean" in value:
                _not_infinite(value["mean"], f"{where}: per_concept[{i}].{key}.mean")
                ci = value.get("ci95", [math.nan, math.nan])
                if not isinstance(ci, list) or len(ci) != 2:
                    raise DataError(f"{where}: per_concept[{i}].{key}.ci95 must be [low, high]")
                for j, bound in enumerate(ci):
                    _not_infinite(bound, f"{where}: per_concept[{i}].{key}.ci95[{j}]")
    _name(evaluation.get("stage"), f"{where}: stage")
    return evaluation


POLICY_NUMBERS = ("accuracy", "steps", "rejects", "llm_calls", "return")


def split_label(evaluation: dict[str, Any]) -> str:
    """The tasks a controller's final table was played on, from its rows' ``tasks`` column ("test tasks")."""
    splits = sorted({str(numbers.get("tasks", "test")) for numbers in evaluation.values()})
    return f"{' and '.join(splits) or 'test'} tasks"


def read_policy_evaluation(path: Path) -> dict[str, Any]:
    """A controller's ``evaluation.json``: policy name -> its numbers (``accuracy``, ``steps``, ...)."""
    evaluation = read_json_object(path, "controller evaluation", EVALUATION_LIMITS)
    where = f"controller evaluation {printable(path)}"
    for policy, numbers in evaluation.items():
        _name(policy, f"{where}: a policy name")
        if not isinstance(numbers, dict):
            raise DataError(f"{where}: {policy[:60]!r} must be an object of numbers")
        for key in POLICY_NUMBERS:
            if key in numbers:
                _not_infinite(numbers[key], f"{where}: {policy[:60]}.{key}")
    return evaluation
