"""Per-concept evaluation of a prompt pool against its controls, with confidence intervals.

``validate`` / ``test`` of ``clova_train.models.PromptTuning`` (and the CLIP demo) score every sample with the unmodified
tool, with the pool, and with controls of the same pool structure (the zero-prompt pool: same entries,
features and retrieval, every prompt zero; the ungated pool: every tuned prompt, rejected ones included).
This module turns those per-sample values into a table per concept: the mean of each column with a 95%
Wilson interval (the values are 0/1 outcomes), and the paired difference pool - zero-prompt with a normal
95% interval over the per-sample differences (the same samples under both, so their noise mostly cancels).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

Z_95 = 1.959963984540054
ALL = "all"


def wilson_interval(successes: float, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a proportion (``(0, 1)`` for ``n == 0``)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    low = 0.0 if successes <= 0 else max(0.0, centre - half)  # exact ends: rounding must not move them
    high = 1.0 if successes >= n else min(1.0, centre + half)
    return low, high


def paired_difference(a: list[float], b: list[float], z: float = Z_95) -> tuple[float, float, float]:
    """Mean of ``a - b`` over paired samples and its normal-approximation interval."""
    n = len(a)
    if n == 0:
        return 0.0, 0.0, 0.0
    diffs = [x - y for x, y in zip(a, b)]
    mean = sum(diffs) / n
    variance = sum((d - mean) ** 2 for d in diffs) / (n - 1) if n > 1 else 0.0
    half = z * math.sqrt(variance / n)
    return mean, mean - half, mean + half


@dataclass
class SampleTable:
    """Per-sample metric values with each sample's key and concept, as gathered from every rank.

    A sample seen twice (a distributed sampler pads uneven splits by repeating samples) counts once.
    """

    columns: list[str]
    rows: dict[str, tuple[str, dict[str, float]]] = field(default_factory=dict)

    def add(self, keys: Iterable[str], concepts: Iterable[str], values: dict[str, list[float]]) -> None:
        for i, (key, concept) in enumerate(zip(keys, concepts)):
            self.rows.setdefault(key, (concept, {name: float(v[i]) for name, v in values.items()}))

    def merge(self, other: SampleTable) -> None:
        for key, row in other.rows.items():
            self.rows.setdefault(key, row)

    def report(self, pool_column: str | None = None, control_column: str | None = None) -> list[dict[str, Any]]:
        """One dict per concept and one for ``all``: ``n``, each column's mean and interval, and the paired
        difference ``pool_column - control_column`` when both are given and present."""
        by_concept: dict[str, list[dict[str, float]]] = {}
        for key in sorted(self.rows):
            concept, values = self.rows[key]
            by_concept.setdefault(concept, []).append(values)
        groups = [(c, by_concept[c]) for c in sorted(by_concept)] + [(ALL, [v for c in by_concept for v in by_concept[c]])]
        report = []
        for concept, values in groups:
            entry: dict[str, Any] = {"concept": concept, "n": len(values)}
            for column in self.columns:
                outcomes = [v[column] for v in values if column in v]
                if outcomes:
                    mean = sum(outcomes) / len(outcomes)
                    entry[column] = {"mean": mean, "ci95": list(wilson_interval(sum(outcomes), len(outcomes)))}
            if pool_column and control_column and all(pool_column in v and control_column in v for v in values):
                mean, low, high = paired_difference([v[pool_column] for v in values], [v[control_column] for v in values])
                entry[f"{pool_column} - {control_column}"] = {"mean": mean, "ci95": [low, high]}
            report.append(entry)
        return report


def format_report(report: list[dict[str, Any]]) -> str:
    """A markdown table of :meth:`SampleTable.report` (mean [95% interval] per column)."""
    columns = [k for k in report[0] if k not in ("concept", "n")] if report else []
    for entry in report:
        columns += [k for k in entry if k not in ("concept", "n") and k not in columns]
    lines = ["| concept | n | " + " | ".join(columns) + " |", "| --- | --- |" + " --- |" * len(columns)]
    for entry in report:
        cells = []
        for column in columns:
            cell = entry.get(column)
            if not isinstance(cell, dict):
                cells.append("-" if cell is None else str(cell))
            elif " - " in column:
                cells.append(f"{cell['mean']:+.3f} [{cell['ci95'][0]:+.3f}, {cell['ci95'][1]:+.3f}]")
            else:
                cells.append(f"{cell['mean']:.3f} [{cell['ci95'][0]:.3f}, {cell['ci95'][1]:.3f}]")
        lines.append(f"| {entry['concept']} | {entry['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
