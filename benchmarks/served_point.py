"""Rows of the operating-point tables (``prompt_pool_controls.py --operating-point``, ``prompt_tool_seeds.py``): a pool
reported where it is served, over seeds.

Per seed the caller gives the margin its calibration chose (on validation data, before the test), the share of test
items whose served answer differs from the unmodified tool's, and the test scores of the unmodified tool, the served
pool, the random-prompt pool at the same margin, and the change on what the tool already knew (the items the
unmodified tool gets right that the served pool gets wrong, as a share of them).
"""

from __future__ import annotations

from dataclasses import dataclass

from results_file import seed_interval


@dataclass(frozen=True)
class ServedSeed:
    """One seed's served operating point and test scores."""

    seed: int
    margin: float
    changed: float  # share of test items whose served answer differs from the unmodified tool's
    unmodified: float
    served: float
    random: float
    known_taken: float  # share of the items the unmodified tool gets right that the served pool gets wrong


def _values(values: list[float], signed: bool = False) -> str:
    return ", ".join(f"{v:+.3f}" if signed else f"{v:.3f}" for v in values)


def operating_point_rows(tool: str, group: str, seeds: list[ServedSeed]) -> list[str]:
    """Markdown rows ``| tool | group | quantity | mean [95% t interval] | per seed |``."""
    differs = [s for s in seeds if s.changed > 0]
    gain = [round(s.served - s.unmodified, 9) + 0.0 for s in seeds]
    learned_vs_random = [round(s.served - s.random, 9) + 0.0 for s in seeds]
    rows = [
        f"| {tool} | {group} | margin chosen on validation | - | {', '.join(f'{s.margin:g}' for s in seeds)} |",
        f"| {tool} | {group} | seeds whose served pool differs from the unmodified tool | {len(differs)} of "
        f"{len(seeds)} | {', '.join(str(s.seed) for s in differs) or '-'} |",
        f"| {tool} | {group} | share of test items answered differently | "
        f"{seed_interval([s.changed for s in seeds])} | {_values([s.changed for s in seeds])} |",
        f"| {tool} | {group} | unmodified tool | {seed_interval([s.unmodified for s in seeds])} | "
        f"{_values([s.unmodified for s in seeds])} |",
        f"| {tool} | {group} | served pool | {seed_interval([s.served for s in seeds])} | "
        f"{_values([s.served for s in seeds])} |",
        f"| {tool} | {group} | served pool - unmodified | {seed_interval(gain, True)} | {_values(gain, True)} |",
        f"| {tool} | {group} | served pool - unmodified, seeds where it differs | "
        f"{seed_interval([round(s.served - s.unmodified, 9) + 0.0 for s in differs], True) if differs else '-'} | "
        f"{_values([s.served - s.unmodified for s in differs], True) or '-'} |",
        f"| {tool} | {group} | random prompts at the same margin | {seed_interval([s.random for s in seeds])} | "
        f"{_values([s.random for s in seeds])} |",
        f"| {tool} | {group} | served pool - random prompts (same margin) | {seed_interval(learned_vs_random, True)} | "
        f"{_values(learned_vs_random, True)} |",
        f"| {tool} | {group} | share of what the unmodified tool got right that the served pool loses | "
        f"{seed_interval([s.known_taken for s in seeds])} | {_values([s.known_taken for s in seeds])} |",
    ]
    return rows


HEADER = ["tool", "group", "quantity", "mean [95% t interval over seeds]", "per seed"]
