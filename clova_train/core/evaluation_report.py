"""Per-concept evaluation of a prompt pool against its controls, with confidence intervals.

``validate`` / ``test`` of ``clova_train.models.PromptTuning`` (and the CLIP demo) score every sample with the unmodified
tool, with the pool, and with controls of the same pool structure (the zero-prompt pool: same entries,
features and retrieval, every prompt zero; the ungated pool: every tuned prompt, rejected ones included).
This module turns those per-sample values into a table per concept: the mean of each column with a 95%
Wilson interval (the values are 0/1 outcomes), and the paired difference pool - zero-prompt with Newcombe's
paired score interval (the same samples under both, so their noise mostly cancels; see :func:`paired_difference`).
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
    """Mean of ``a - b`` over paired samples and its 95% interval.

    0/1 outcomes (every value 0 or 1) get Newcombe's hybrid score interval for paired proportions (Newcombe 1998,
    method 10: Wilson intervals of both proportions combined with the pairs' correlation), which stays inside
    [-1, 1] however few the samples; other values get Student's t interval over the per-sample differences.
    """
    n = len(a)
    if n == 0:
        return 0.0, 0.0, 0.0
    diffs = [x - y for x, y in zip(a, b)]
    mean = sum(diffs) / n
    if all(v in (0.0, 1.0) for v in (*a, *b)):
        return (mean, *_newcombe_paired_interval(a, b, z))
    if n == 1:
        return mean, mean, mean
    from scipy import stats

    variance = sum((d - mean) ** 2 for d in diffs) / (n - 1)
    half = stats.t.ppf(stats.norm.cdf(z), n - 1) * math.sqrt(variance / n)  # the t quantile of z's coverage
    return mean, mean - half, mean + half


def _newcombe_paired_interval(a: list[float], b: list[float], z: float) -> tuple[float, float]:
    n = len(a)
    both = sum(1 for x, y in zip(a, b) if x and y)
    only_a = sum(1 for x, y in zip(a, b) if x and not y)
    only_b = sum(1 for x, y in zip(a, b) if y and not x)
    neither = n - both - only_a - only_b
    p1, p2 = (both + only_a) / n, (both + only_b) / n
    l1, u1 = wilson_interval(both + only_a, n, z)
    l2, u2 = wilson_interval(both + only_b, n, z)
    margins = (both + only_a) * (only_b + neither) * (both + only_b) * (only_a + neither)
    phi = (both * neither - only_a * only_b) / math.sqrt(margins) if margins else 0.0
    below = math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    above = math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    difference = p1 - p2
    return max(-1.0, difference - below), min(1.0, difference + above)  # the clamps only absorb rounding


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
