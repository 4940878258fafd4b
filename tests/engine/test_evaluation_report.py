"""Per-concept evaluation reports: Wilson intervals, paired differences, each sample counted once."""

from __future__ import annotations

import pytest

from clova_train.core.evaluation_report import SampleTable, format_report, paired_difference, wilson_interval


@pytest.mark.parametrize(("successes", "n", "low", "high"), [
    (0, 10, 0.0, 0.2775), (5, 10, 0.2366, 0.7634), (10, 10, 0.7225, 1.0), (60, 100, 0.5020, 0.6906)])
def test_wilson_interval_matches_hand_worked_values(successes: int, n: int, low: float, high: float) -> None:
    assert wilson_interval(successes, n) == pytest.approx((low, high), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_paired_difference_of_outcomes_is_newcombes_interval() -> None:
    # Newcombe (1998) method 10 by hand: 1 pair both right, 2 only a, 1 neither (n = 4); Wilson (0.3006, 0.9544) for
    # 3/4 and (0.0456, 0.6994) for 1/4, phi = 1/3: mean 0.5, [0.5 - 0.5189, 0.5 + 0.2361]. The normal interval that
    # this replaced gave [-0.066, +1.066] here.
    mean, low, high = paired_difference([1, 1, 1, 0], [0, 1, 0, 0])
    assert mean == 0.5 and (low, high) == pytest.approx((-0.0189, 0.7361), abs=1e-4)
    assert paired_difference([], []) == (0.0, 0.0, 0.0)


def test_paired_outcome_intervals_stay_in_range_and_hold_their_estimate() -> None:
    import itertools

    for n in range(1, 6):  # every pair of 0/1 vectors of up to 5 samples
        for a in itertools.product((0, 1), repeat=n):
            for b in itertools.product((0, 1), repeat=n):
                mean, low, high = paired_difference(list(a), list(b))
                assert -1.0 <= low <= mean <= high <= 1.0, (a, b, low, high)


def test_paired_difference_of_scores_is_students_t_interval() -> None:
    mean, low, high = paired_difference([0.5, 0.7, 0.9, 0.6], [0.5, 0.5, 0.5, 0.5])
    # differences 0, 0.2, 0.4, 0.1: mean 0.175, sd 0.17078, t(0.975, 3 df) = 3.18245
    assert mean == pytest.approx(0.175) and high - mean == pytest.approx(3.18245 * 0.17078 / 2, rel=1e-4)
    assert mean - low == pytest.approx(high - mean)


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
