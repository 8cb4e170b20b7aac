"""The one percentile rule every bench and ``fleet demo`` report with (fleet/bench/measure.py):
linear interpolation between the closest ranks, numpy's default."""

from __future__ import annotations

import math
import statistics

import pytest

from fleet.bench.measure import jain, percentile


def test_percentiles_interpolate_between_the_closest_ranks() -> None:
    values = [15.0, 20.0, 35.0, 40.0, 50.0]
    assert percentile(values, 50) == 35.0
    assert percentile(values, 25) == 20.0
    assert percentile(values, 40) == pytest.approx(29.0)  # position 1.6: 20 + 0.6 * 15
    assert percentile(values, 95) == pytest.approx(48.0)  # position 3.8: 40 + 0.8 * 10
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)


def test_the_order_of_the_values_does_not_matter() -> None:
    assert percentile([50.0, 15.0, 40.0, 20.0, 35.0], 95) == pytest.approx(48.0)


def test_p50_is_the_median() -> None:
    for values in ([3.0, 1.0, 2.0], [4.0, 1.0, 3.0, 2.0], [0.5, 9.0, 2.5, 7.0, 1.0, 3.0]):
        assert percentile(values, 50) == statistics.median(values)


def test_p0_and_p100_are_the_minimum_and_the_maximum() -> None:
    values = [7.0, 3.0, 9.0, 1.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 9.0


def test_one_value_is_every_percentile() -> None:
    for q in (0, 50, 99, 100):
        assert percentile([4.2], q) == 4.2


def test_no_values_is_an_error_unless_a_default_is_given() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    assert math.isnan(percentile([], 95, default=math.nan))
    assert percentile([], 95, default=0.0) == 0.0


def test_a_percentile_outside_0_to_100_is_an_error() -> None:
    for q in (-1, 100.5):
        with pytest.raises(ValueError):
            percentile([1.0, 2.0], q)


def test_jain_index() -> None:
    assert jain([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert jain([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert math.isnan(jain([]))
