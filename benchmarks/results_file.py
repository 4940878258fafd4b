"""Shared by the benchmarks: describe the machine and append a result table to a results file."""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import torch
from scipy import stats

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine() -> str:
    """CPU model and core count (or the GPU name) and the torch version."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}; torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores; torch {torch.__version__}"


def timestamp() -> str:
    return f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"


def append_result(name: str, title: str, table: str) -> Path:
    """Append ``table`` to ``results/<name>.md`` (created with ``title`` as its heading)."""
    path = RESULTS_DIR / f"{name}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_text(f"# {title}\n\nWritten by `python benchmarks/{name}.py`; newest last.\n")
    with path.open("a") as handle:
        handle.write(table)
    return path


def publish(name: str, title: str, heading: str, description: str, columns: list[str], rows: list[str], record: bool) -> str:
    """Print a result table (``rows`` are markdown rows) and, with ``record``, append it to the results file."""
    table = (
        f"\n## {timestamp()}, {heading}\n\n{description}\n\n"
        f"| {' | '.join(columns)} |\n| {' | '.join('---' for _ in columns)} |\n" + "\n".join(rows) + "\n"
    )
    print(table)
    if record:
        append_result(name, title, table)
    return table


def seed_interval(values: list[float], signed: bool = False, limits: tuple[float, float] | None = (0.0, 1.0)) -> str:
    """``mean [low, high]``: the mean of per-seed values with a 95% Student t interval from their spread (scipy),
    cut to the values' range: ``limits`` (accuracies by default; None: unbounded) or, for a ``signed`` difference of
    two such values, +-(high - low). ``signed`` also prints a + on positive numbers."""
    form = "{:+.3f}" if signed else "{:.3f}"
    mean = sum(values) / len(values)
    if len(values) < 2:
        return form.format(mean)
    if len(set(values)) == 1:
        low = high = mean
    else:
        low, high = stats.t.interval(0.95, len(values) - 1, loc=mean, scale=stats.sem(values))
    if limits is not None:
        bottom, top = (-(limits[1] - limits[0]), limits[1] - limits[0]) if signed else limits
        low, high = max(low, bottom), min(high, top)
    return f"{form.format(mean)} [{form.format(low)}, {form.format(high)}]"


def add_seeded_run_arguments(parser: argparse.ArgumentParser, seeds_help: str = "training seeds") -> None:
    """``--seeds`` (default 0-4), ``--runs-dir`` and ``--no-record``, shared by the benchmarks that run over seeds."""
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help=seeds_help)
    parser.add_argument("--runs-dir", type=Path, default=None,
                        help="where the runs are kept; a rerun reuses every finished one (default: temporary)")
    parser.add_argument("--no-record", action="store_true", help="print the tables without appending them")


@contextmanager
def runs_directory(path: Path | None) -> Iterator[Path]:
    """``path`` (created), or a temporary directory removed afterwards."""
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp)
