import time

import numpy as np
import pytest

from hpcckpt.policy.formulas import daly, young
from hpcckpt.policy.simulate import (
    MAX_SEGMENTS,
    best_interval,
    default_intervals,
    simulate,
)

W = 48 * 3600.0
M = 12 * 3600.0
C = 300.0
R = 120.0


def test_deterministic_with_seed():
    grid = [1800.0, 3600.0, 7200.0]
    a = simulate(W, grid, C, M, R, runs=500, seed=7)
    b = simulate(W, grid, C, M, R, runs=500, seed=7)
    c = simulate(W, grid, C, M, R, runs=500, seed=8)
    np.testing.assert_array_equal(a.mean_makespan, b.mean_makespan)
    assert not np.array_equal(a.mean_makespan, c.mean_makespan)


def test_no_failures_gives_exact_makespan():
    # MTBF of a million years: every run is work plus the checkpoints between segments
    result = simulate(W, [3600.0, 5000.0], C, 3.15e13, R, runs=50, seed=1)
    assert result.mean_makespan[0] == pytest.approx(W + 47 * C)
    assert result.mean_makespan[1] == pytest.approx(W + 34 * C)  # 35 segments, 34 checkpoints
    assert result.mean_failures.tolist() == [0.0, 0.0]


def test_simulation_matches_the_exact_expectation():
    grid = default_intervals(C, M, 8, 900, 6 * 3600, work=W)
    result = simulate(W, grid, C, M, R, runs=4000, seed=3)
    se = (result.makespan_high - result.mean_makespan) / 1.96
    z = (result.mean_makespan - result.expected_makespan) / se
    assert np.all(np.abs(z) < 4.5), z
    assert np.all(result.efficiency_low <= result.efficiency)
    assert np.all(result.efficiency <= result.efficiency_high)


def test_daly_is_near_the_simulated_optimum():
    # Monte-Carlo standard error of the efficiency here is about 0.05 points,
    # so 0.3 points is ~6 standard errors: loose for noise, tight for a wrong model.
    t_daly = daly(C, M)
    grid = np.unique(np.concatenate([default_intervals(C, M, 20, work=W), [t_daly, 2 * t_daly]]))
    result = simulate(W, grid, C, M, R, runs=4000, seed=1)
    best = result.efficiency.max()
    at_daly = result.efficiency[np.flatnonzero(grid == t_daly)[0]]
    at_double = result.efficiency[np.flatnonzero(grid == 2 * t_daly)[0]]
    assert best - at_daly < 0.003
    assert best - at_double > 0.01  # and the curve is not flat enough to make that trivial
    assert 0.6 < best_interval(result) / t_daly < 1.6
    assert best == pytest.approx(0.885, abs=0.005)


def test_infeasible_intervals_are_reported_not_simulated():
    result = simulate(10 * M, [0.5 * M, 20 * M], C, M, R, runs=100, seed=1)
    assert np.isfinite(result.mean_makespan[0])
    assert result.mean_makespan[1] == np.inf
    assert result.efficiency[1] == 0.0
    assert result.best_index == 0


def test_validation():
    with pytest.raises(ValueError, match="segments"):
        simulate(1e9, [1.0], C, M, runs=10)
    assert MAX_SEGMENTS >= 100_000
    with pytest.raises(ValueError, match="work"):
        simulate(0, [1.0], C, M)
    with pytest.raises(ValueError, match="intervals"):
        simulate(W, [0.0], C, M)
    with pytest.raises(ValueError, match="runs"):
        simulate(W, [3600.0], C, M, runs=1)


def test_default_intervals():
    grid = default_intervals(C, M, 30)
    assert grid.size == 30
    assert grid[0] == pytest.approx(daly(C, M) / 5)
    assert grid[-1] == pytest.approx(daly(C, M) * 5)
    assert np.all(np.diff(grid) > 0)
    capped = default_intervals(C, M, 10, work=10_000.0)
    assert capped[-1] == pytest.approx(10_000.0)
    assert default_intervals(C, M, 5, 600, 6000)[0] == 600
    with pytest.raises(ValueError, match="min interval"):
        default_intervals(C, M, 5, 6000, 600)


def test_rows_are_plain_floats():
    result = simulate(W, [young(C, M)], C, M, runs=100, seed=1)
    (row,) = result.rows()
    assert set(row) >= {"interval", "mean_makespan", "efficiency", "efficiency_low"}
    assert all(type(v) is float for v in row.values())


@pytest.mark.slow
def test_ten_thousand_runs_by_fifty_intervals_take_seconds():
    grid = default_intervals(C, M, 50, 600, 6 * 3600, work=W)
    start = time.perf_counter()
    simulate(W, grid, C, M, R, runs=10_000, seed=1)
    assert time.perf_counter() - start < 15.0
