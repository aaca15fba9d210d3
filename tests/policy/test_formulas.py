import math

import numpy as np
import pytest

from hpcckpt.policy.durations import YEAR
from hpcckpt.policy.formulas import (
    DEFAULT_NODE_MTBF,
    daly,
    efficiency,
    expected_makespan,
    expected_segment_time,
    expected_waste,
    job_mtbf,
    optimal_interval,
    young,
)

M = 12 * 3600.0
C = 300.0


def test_young_reference():
    # sqrt(2 * 300 * 43200) = sqrt(25 920 000)
    assert young(C, M) == pytest.approx(5091.1688, abs=1e-3)


def test_daly_reference():
    # x = C/2M = 1/288: 5091.1688 * (1 + sqrt(x)/3 + x/9) - 300
    assert daly(C, M) == pytest.approx(4893.133, abs=1e-2)


def test_daly_near_and_beyond_two_mtbf():
    # C = 79 s, M = 40 s: x = 0.9875, sqrt(6320) * (1 + 0.33124 + 0.10972) - 79 = 35.55
    assert daly(79, 40) == pytest.approx(35.5545, abs=1e-3)
    assert daly(80, 40) == 40.0  # C = 2M: T = M
    assert daly(1000, 40) == 40.0


def test_zero_cost_gives_zero_interval():
    assert young(0, M) == 0.0
    assert daly(0, M) == 0.0
    assert optimal_interval(0, M) == 0.0


@pytest.mark.parametrize("func", [young, daly, optimal_interval])
@pytest.mark.parametrize(("cost", "mtbf"), [(-1, M), (C, 0), (C, -5), (math.nan, M), (C, math.inf)])
def test_formulas_validate(func, cost, mtbf):
    with pytest.raises(ValueError, match="cost|MTBF"):
        func(cost, mtbf)


def test_efficiency_reference():
    # T = 4893.133: E = 43200 * (exp(5193.133 / 43200) - 1) = 5518.2 s, T/E = 0.88673
    assert efficiency(daly(C, M), C, M) == pytest.approx(0.886732, abs=1e-6)
    assert expected_waste(daly(C, M), C, M) == pytest.approx(0.113268, abs=1e-6)


def test_restart_cost_scales_segment_time():
    t = 4000.0
    base = expected_segment_time(t, C, M)
    assert expected_segment_time(t, C, M, 600) == pytest.approx(base * math.exp(600 / M))
    assert efficiency(t, C, M, 600) == pytest.approx(efficiency(t, C, M) * math.exp(-600 / M))


def test_waste_matches_first_order_when_cost_is_small():
    cost, mtbf = 1.0, 1e6
    t = young(cost, mtbf)
    first_order = cost / t + t / (2 * mtbf)
    assert expected_waste(t, cost, mtbf) == pytest.approx(first_order, rel=0.01)


def test_efficiency_overflow_is_zero():
    assert efficiency(1e9, C, 10.0) == 0.0
    assert expected_segment_time(1e9, C, 10.0) == math.inf


def test_efficiency_validates_interval():
    with pytest.raises(ValueError, match="interval"):
        efficiency(0, C, M)


def test_optimal_interval_maximises_efficiency():
    t_opt = optimal_interval(C, M)
    grid = np.linspace(0.5 * t_opt, 2 * t_opt, 20001)
    effs = np.array([efficiency(t, C, M) for t in grid])
    assert grid[effs.argmax()] == pytest.approx(t_opt, rel=1e-3)
    # the first-order condition T/M = 1 - exp(-(T+C)/M)
    assert t_opt / M == pytest.approx(-math.expm1(-(t_opt + C) / M), abs=1e-12)
    # Daly is within a hair of the exact optimum here, Young is 4 % long
    assert daly(C, M) == pytest.approx(t_opt, rel=1e-4)
    assert young(C, M) / t_opt == pytest.approx(1.0405, abs=1e-3)


def test_expected_makespan_counts_no_final_checkpoint():
    # 4 segments of 1 h: three followed by a checkpoint, the last not.
    work, t = 4 * 3600.0, 3600.0
    expected = 3 * expected_segment_time(t, C, M, 60) + expected_segment_time(t, 0, M, 60)
    assert expected_makespan(work, t, C, M, 60) == pytest.approx(expected)
    # a partial last segment: 2.5 h of work at 1 h intervals
    partial = 2 * expected_segment_time(t, C, M) + expected_segment_time(1800, 0, M)
    assert expected_makespan(9000, t, C, M) == pytest.approx(partial)
    # failure-free limit: work plus the checkpoints
    assert expected_makespan(work, t, C, 1e15) == pytest.approx(work + 3 * C, rel=1e-6)


def test_job_mtbf():
    assert DEFAULT_NODE_MTBF == 5 * YEAR
    assert job_mtbf(3600.0) == 3600.0
    assert job_mtbf(nodes=128) == pytest.approx(5 * YEAR / 128)
    assert job_mtbf(node_mtbf=1000.0, nodes=4) == 250.0
    assert job_mtbf(3600.0, node_mtbf=1.0, nodes=99) == 3600.0  # an explicit MTBF wins
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="nodes"):
            job_mtbf(nodes=bad)
    with pytest.raises(ValueError, match="MTBF"):
        job_mtbf(0.0)
