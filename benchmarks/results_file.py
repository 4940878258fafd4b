"""Shared by the benchmarks: describe the machine and append a result table to a results file."""

from __future__ import annotations

import os
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch

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
