"""Percentiles over windows and the latency-vs-load fit."""

from __future__ import annotations

import random

import pytest

from planner.estimate import LoadFit, Window, quantile

pytestmark = pytest.mark.unit


def test_quantile_interpolates_inside_the_bucket_like_promql():
    # 10 observations in (0, 1], 10 in (1, 2]: the 90th percentile is 80% into the second bucket
    assert quantile(0.9, [1.0, 2.0], [10, 10, 0]) == pytest.approx(1.8)
    assert quantile(0.5, [1.0, 2.0], [10, 10, 0]) == pytest.approx(1.0)
    assert quantile(0.9, [1.0, 2.0], [0, 0, 0]) is None
    assert quantile(0.99, [1.0, 2.0], [1, 0, 5]) == 2.0  # the +Inf bucket answers the largest bound


def test_quantile_matches_the_sample_percentile_of_many_observations():
    rng = random.Random(7)
    values = [rng.expovariate(20) for _ in range(20000)]
    bounds = [i / 200 for i in range(1, 200)]
    counts = [0] * (len(bounds) + 1)
    for v in values:
        counts[next((i for i, b in enumerate(bounds) if v <= b), len(bounds))] += 1
    exact = sorted(values)[int(0.9 * len(values))]
    assert quantile(0.9, bounds, counts) == pytest.approx(exact, abs=0.005)


def test_quantile_rejects_bad_input():
    with pytest.raises(ValueError):
        quantile(1.5, [1.0], [1, 1])
    with pytest.raises(ValueError):
        quantile(0.5, [1.0], [1])


def test_window_reports_growth_over_its_span_only():
    w = Window(10.0)
    assert w.delta() is None
    for t in range(0, 31, 5):
        w.add(float(t), [t * 2.0, 1.0])
    seconds, growth = w.delta()
    assert seconds == 10.0 and growth == (20.0, 0.0)  # from t=20 to t=30


def test_window_starts_over_when_a_counter_goes_back():
    w = Window(60.0)
    w.add(0.0, [100.0])
    w.add(5.0, [120.0])
    w.add(10.0, [3.0])  # the process behind it restarted
    assert w.delta() is None
    w.add(15.0, [9.0])
    assert w.delta() == (5.0, (6.0,))


def test_fit_recovers_a_line_and_predicts_after_a_removal():
    fit = LoadFit()
    for load in range(1, 11):
        fit.add(load, 0.010 + 0.005 * load)
    line = fit.fit()
    assert line.a == pytest.approx(0.010) and line.b == pytest.approx(0.005)
    # 4 workers at 6 in flight each: the same 24 requests on 3 workers is 8 each
    assert fit.after_removal(0.040, 6.0, 4) == pytest.approx(0.010 + 0.005 * 8)
    assert fit.after_removal(0.040, 6.0, 1) is None  # the last worker cannot go


def test_without_a_fit_the_estimate_assumes_latency_proportional_to_load():
    fit = LoadFit()
    fit.add(2.0, 0.02)
    assert fit.fit() is None
    assert fit.after_removal(0.02, 2.0, 2) == pytest.approx(0.04)
    assert fit.after_removal(None, 2.0, 2) is None


def test_a_falling_or_flat_load_range_is_not_a_model():
    fit = LoadFit()
    for load in range(1, 11):
        fit.add(load, 0.05 - 0.001 * load)
    assert fit.fit() is None
    narrow = LoadFit()
    for _ in range(10):
        narrow.add(3.0, 0.02)
    assert narrow.fit() is None
