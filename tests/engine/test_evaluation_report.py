"""Per-concept evaluation reports: Wilson intervals, paired differences, each sample counted once."""

from __future__ import annotations

import pytest

from clova_train.core.evaluation_report import SampleTable, format_report, paired_difference, wilson_interval


@pytest.mark.parametrize(("successes", "n", "low", "high"), [
    (0, 10, 0.0, 0.2775), (5, 10, 0.2366, 0.7634), (10, 10, 0.7225, 1.0), (60, 100, 0.5020, 0.6906)])
def test_wilson_interval_matches_hand_worked_values(successes: int, n: int, low: float, high: float) -> None:
    assert wilson_interval(successes, n) == pytest.approx((low, high), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_paired_difference_interval() -> None:
    mean, low, high = paired_difference([1, 1, 1, 0], [0, 1, 0, 0])
    # differences 1, 0, 1, 0: mean 0.5, sample sd 0.5774, half width 1.96 * 0.5774 / 2
    assert mean == 0.5 and high - mean == pytest.approx(1.959964 * 0.57735 / 2, rel=1e-4) and mean - low == high - mean
    assert paired_difference([], []) == (0.0, 0.0, 0.0)


def test_samples_repeated_by_a_padding_sampler_count_once() -> None:
    rank0, rank1 = SampleTable(["pool", "zero"]), SampleTable(["pool", "zero"])
    rank0.add(["a", "b"], ["red", "red"], {"pool": [1, 1], "zero": [1, 0]})
    rank1.add(["c", "a"], ["blue", "red"], {"pool": [0, 1], "zero": [0, 1]})  # "a" again: a padded repeat
    rank0.merge(rank1)
    report = {row["concept"]: row for row in rank0.report("pool", "zero")}
    assert report["red"]["n"] == 2 and report["blue"]["n"] == 1 and report["all"]["n"] == 3
    assert report["red"]["zero"]["mean"] == 0.5 and report["all"]["pool"]["mean"] == pytest.approx(2 / 3)
    assert report["all"]["pool - zero"]["mean"] == pytest.approx(1 / 3)
    table = format_report(list(report.values()))
    assert table.splitlines()[0] == "| concept | n | pool | zero | pool - zero |"
    assert "| all | 3 | 0.667 [" in table and "+0.333 [" in table
