"""The block bootstrap of bench.agentic_ab.stats against known answers: the analytic interval
of a normal mean, its coverage over many samples, wider intervals for correlated data, paired
changes, and no interval from too few blocks."""

from __future__ import annotations

import numpy as np

from bench.agentic_ab.stats import MIN_BLOCKS, Resamples, independent_interval


def test_interval_of_a_normal_mean_matches_the_analytic_one():
    sample = np.random.default_rng(7).normal(10.0, 2.0, size=400)
    low, high = Resamples(400, block=1, seed=3).interval(lambda i: sample[i].mean())
    half = 1.959964 * sample.std(ddof=1) / np.sqrt(400)
    assert abs(low - (sample.mean() - half)) < 0.1 * half
    assert abs(high - (sample.mean() + half)) < 0.1 * half


def test_coverage_of_the_true_mean_is_near_95_percent():
    rng = np.random.default_rng(11)
    hits, trials = 0, 300
    for trial in range(trials):
        sample = rng.normal(3.0, 2.0, size=60)
        low, high = Resamples(60, block=1, count=500, seed=trial).interval(
            lambda i: sample[i].mean())
        hits += low <= 3.0 <= high
    # A percentile interval at n=60 covers ~94 %; 300 trials put 95 % of runs within +-2.6 pt.
    assert 0.90 <= hits / trials <= 0.98


def test_blocks_widen_the_interval_of_correlated_data():
    rng = np.random.default_rng(5)
    noise = rng.normal(size=2000)
    series = np.empty(2000)
    series[0] = noise[0]
    for t in range(1, 2000):  # AR(1), phi 0.9: the variance of the mean is ~19x the iid one
        series[t] = 0.9 * series[t - 1] + noise[t]
    iid = Resamples(2000, block=1).interval(lambda i: series[i].mean())
    blocked = Resamples(2000, block=50).interval(lambda i: series[i].mean())
    assert (blocked[1] - blocked[0]) > 2.5 * (iid[1] - iid[0])


def test_paired_change_and_the_minimum_number_of_blocks():
    values = np.arange(100, dtype=float)
    samples = Resamples(100, block=10)
    # The same rows in both arms: every resample's change is exactly zero.
    assert samples.interval(lambda i: values[i].mean() - values[i].mean()) == (0.0, 0.0)
    # A constant shift survives resampling exactly.
    assert samples.interval(lambda i: (values[i] + 2).mean() - values[i].mean()) == (2.0, 2.0)
    assert Resamples(10 * (MIN_BLOCKS - 1), block=10).interval(lambda i: 1.0) is None
    assert Resamples(10 * MIN_BLOCKS - 9, block=10).interval(lambda i: 1.0) == (1.0, 1.0)
    # Every resample has as many blocks as the data; the short last block stays short.
    assert all(len(i) <= 100 and i.max() < 100 for i in Resamples(95, block=10).indices)


def test_independent_interval_of_a_difference_of_means():
    rng = np.random.default_rng(2)
    a, b = rng.normal(5.0, 1.0, size=500), rng.normal(4.0, 1.0, size=500)
    low, high = independent_interval(Resamples(500, block=1, seed=1), lambda i: a[i].mean(),
                                     Resamples(500, block=1, seed=2), lambda i: b[i].mean(),
                                     lambda x, y: x - y)
    half = 1.959964 * np.sqrt(a.var(ddof=1) / 500 + b.var(ddof=1) / 500)
    centre = a.mean() - b.mean()
    assert abs(low - (centre - half)) < 0.15 * half and abs(high - (centre + half)) < 0.15 * half
