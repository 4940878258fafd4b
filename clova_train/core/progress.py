"""Progress of a long step, on a terminal and off it: a tqdm bar when stderr is a terminal, and otherwise (a log
file, a CI job, ``make demo > log``) a line every 30 seconds and one at the end, so a long step is never silent."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

LOG_EVERY_SECONDS = 30.0


class LoggedProgress:
    """tqdm's ``update``/``close`` interface, written as plain lines: ``<desc>: 40/100 step, 12 s, about 18 s left``.

    Args:
        total: the amount of work (steps, bytes, inputs).
        desc: what is being done.
        unit: the unit of ``total``; ``B`` is shown in MB.
        stream: where the lines go (default stderr).
        every: seconds between lines (default ``LOG_EVERY_SECONDS``).
    """

    def __init__(self, total: float, desc: str, unit: str = "it", stream: TextIO | None = None,
                 every: float | None = None) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.every = LOG_EVERY_SECONDS if every is None else every
        self.stream = stream or sys.stderr
        self.done = 0.0
        self.start = self.last = time.monotonic()

    def _amount(self, value: float) -> str:
        return f"{value / 1e6:,.0f} MB" if self.unit == "B" else f"{value:,.0f}"

    def update(self, amount: float = 1) -> None:
        self.done += amount
        now = time.monotonic()
        if now - self.last >= self.every or self.done >= self.total:
            self.last = now
            elapsed = now - self.start
            left = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
            unit = "" if self.unit == "B" else f" {self.unit}"
            print(f"{self.desc}: {self._amount(self.done)}/{self._amount(self.total)}{unit}, {elapsed:.0f} s, "
                  f"about {left:.0f} s left", file=self.stream, flush=True)

    def close(self) -> None:
        pass

    def __enter__(self) -> LoggedProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress(total: float, desc: str, unit: str = "it", disable: bool = False) -> Any:
    """A progress reporter with ``update(n)`` and ``close()`` (a context manager too): tqdm on a terminal, lines
    otherwise; nothing when ``disable``."""
    if disable:
        from tqdm import tqdm

        return tqdm(total=total, disable=True)
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", leave=False)
    return LoggedProgress(total, desc, unit)


def progress_over(items: Any, desc: str, unit: str = "it", disable: bool = False) -> Any:
    """Iterate ``items`` (a sized iterable) reporting progress as :func:`progress` does."""
    items = list(items) if not hasattr(items, "__len__") else items
    with progress(len(items), desc, unit, disable) as bar:
        for item in items:
            yield item
            bar.update(1)
