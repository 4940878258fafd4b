"""What a run directory holds, read for the report: its kind, its logged metrics and its result files.

A prompt-tuning run has ``summary.json`` (every instance's gate verdict and learning curve) and, after
``validate``/``test``, ``evaluation/<stage>.json``; a LoRA run has ``adapter/``; a controller run has
``logs/progress.csv`` (stable-baselines3's CSV log) and ``evaluation.json``. Lightning's CSV logger writes
``metrics.csv`` under the run.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clova_train.core.errors import DataError
from clova_train.core.safe_files import read_json_object
from clova_train.core.run_manifest import SUMMARY_FILE, read_run_manifest

KINDS = ("prompt_tuning", "lora", "controller")


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
    """Every numeric column of a CSV log as a series against the first of ``x_columns`` the row has."""
    series: dict[str, Series] = {}
    try:
        with path.open(newline="") as handle:
            for row in csv.DictReader(handle):
                x = next((_number(row.get(c)) for c in x_columns if _number(row.get(c)) is not None), None)
                if x is None:
                    continue
                for key, value in row.items():
                    y = _number(value)
                    if key and key not in x_columns and y is not None:
                        series.setdefault(key, Series()).x.append(x)
                        series[key].y.append(y)
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise DataError(f"cannot read the log {path}: {err}") from err
    return series


def _number(value: Any) -> float | None:
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
    return sorted(found, key=lambda p: p.stat().st_mtime)


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
        metrics = read_series(progress, ("time/total_timesteps",)) if progress.is_file() else {}
        evaluations = {}
        if (directory / "evaluation.json").is_file():
            evaluations["held-out tasks"] = read_json_object(directory / "evaluation.json", "controller evaluation")
        return Run(directory, kind, metrics, evaluations=evaluations)
    metrics = merged_series(csv_logs(directory))
    summary = read_json_object(directory / SUMMARY_FILE, "run summary") if (directory / SUMMARY_FILE).is_file() \
        else None
    evaluations = {path.stem: read_json_object(path, "evaluation")
                   for path in sorted((directory / "evaluation").glob("*.json"))}
    return Run(directory, kind, metrics, summary, evaluations)
