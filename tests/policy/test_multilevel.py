"""The two-level interval model and its simulator (pure)."""

from __future__ import annotations

import math

import pytest

from hpcckpt.policy import multilevel
from hpcckpt.policy.formulas import daly

C1, C2, M = 20.0, 300.0, 6 * 3600.0  # node-local save, drain, job MTBF


def test_each_level_interval_is_the_optimum_of_the_model_for_its_drain_period():
    plan = multilevel.plan_levels(C1, C2, M, 0.8)
    w = multilevel.waste(plan.interval, plan.drain_every, C1, C2, M, 0.8)
    assert w == pytest.approx(plan.waste)
    for tau in (plan.interval * 0.8, plan.interval * 1.25):
        assert multilevel.waste(tau, plan.drain_every, C1, C2, M, 0.8) > w
    for k in (plan.drain_every - 1, plan.drain_every + 1):
        best_tau = min(
            multilevel.waste(t, k, C1, C2, M, 0.8)
            for t in [plan.interval * x / 20 for x in range(5, 60)]
        )
        assert best_tau > w


def test_the_more_failures_the_node_local_tier_survives_the_rarer_the_drain():
    ks = [multilevel.plan_levels(C1, C2, M, f).drain_every for f in (0.0, 0.5, 0.8, 0.95)]
    assert ks[0] == 1  # nothing survives on the node-local tier: drain every checkpoint
    assert ks == sorted(ks) and ks[-1] > ks[1]


def test_with_no_node_local_survival_it_is_youngs_interval_for_the_drain():
    plan = multilevel.plan_levels(C1, C2, M, 0.0)
    assert plan.drain_every == 1
    assert plan.interval == pytest.approx(math.sqrt(2 * C2 * M))


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="fraction of failures"):
        multilevel.plan_levels(C1, C2, M, 1.5)
    with pytest.raises(ValueError, match="MTBF"):
        multilevel.plan_levels(C1, C2, 0.0)
    with pytest.raises(ValueError, match="costs must be > 0"):
        multilevel.plan_levels(0.0, C2, M)


def test_the_two_level_choice_beats_a_single_level_on_the_same_failure_traces():
    two = multilevel.plan_levels(C1, C2, M, 0.8, 60, 120)
    result = multilevel.simulate_levels(
        48 * 3600, [(two.interval, two.drain_every), (daly(C2, M), 1)], C1, C2, M, 0.8, 60, 120,
        runs=400, seed=3, single=[False, True],
    )  # fmt: skip
    gain = result.mean_makespan[1] - result.mean_makespan[0]
    assert gain > 3 * (result.half_width[0] + result.half_width[1]), result
    assert result.mean_failures > 5  # the traces do fail, often


def test_without_failures_the_makespan_is_work_plus_the_checkpoints():
    # an MTBF of centuries: no failure in 10 h; 10 segments of 1 h, 9 checkpoints
    result = multilevel.simulate_levels(
        36000.0, [(3600.0, 3), (3600.0, 1)], C1, C2, 1e12, 0.8, runs=3, single=[False, True]
    )
    drained = 3  # checkpoints 3, 6, 9 of 9
    assert result.mean_makespan[0] == pytest.approx(36000 + 6 * C1 + drained * C2)
    assert result.mean_makespan[1] == pytest.approx(36000 + 9 * C2)


def test_failures_the_node_local_tier_survives_cost_less_than_the_others():
    # the same strategy and traces; every failure recoverable from level 1, or none
    kw = dict(runs=300, seed=5)
    local = multilevel.simulate_levels(48 * 3600, [(1800.0, 8)], C1, C2, M, 1.0, **kw)
    remote = multilevel.simulate_levels(48 * 3600, [(1800.0, 8)], C1, C2, M, 0.0, **kw)
    assert local.mean_makespan[0] < remote.mean_makespan[0]


def test_compare_levels_runs_both_strategies_on_the_same_traces():
    c = multilevel.compare_levels(48 * 3600, M, C2, C1, 0.8, 60, 120, runs=300, seed=3)
    two, one = c.strategies
    assert (two.interval, two.drain_every) == (c.two.interval, c.two.drain_every)
    assert one.drain_every == 1 and one.interval == pytest.approx(daly(C2, M))
    assert two.efficiency > one.efficiency and c.gain > 0
    assert c.gain == pytest.approx(one.mean_makespan - two.mean_makespan)
    again = multilevel.compare_levels(48 * 3600, M, C2, C1, 0.8, 60, 120, runs=300, seed=3)
    assert again.strategies == c.strategies  # the same seed: the same traces, the same numbers


def test_compare_levels_refuses_a_cost_the_model_cannot_take():
    with pytest.raises(ValueError, match="costs must be > 0"):
        multilevel.compare_levels(3600, M, C2, 0.0)
