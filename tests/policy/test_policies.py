import pytest

from hpcckpt.policy.formulas import daly, young
from hpcckpt.policy.policies import (
    DEFAULT_BANDWIDTH,
    MAX_INTERVAL,
    MIN_INTERVAL,
    CostTracker,
    Daly,
    EverySteps,
    Fixed,
    IntervalPolicy,
    Young,
    initial_cost_estimate,
    make_policy,
)

M = 12 * 3600.0


def test_formula_policies_follow_the_formulas():
    assert Young(M).interval(300) == pytest.approx(5091.1688, abs=1e-3)
    assert Daly(M).interval(300) == pytest.approx(4893.133, abs=1e-2)
    assert Daly(M).interval(30) == pytest.approx(daly(30, M))
    assert Young(M).interval(30) == pytest.approx(young(30, M))


def test_formula_policies_clamp():
    assert MIN_INTERVAL == 60.0 and MAX_INTERVAL == 86400.0
    assert Daly(M).interval(0.0) == MIN_INTERVAL
    assert Young(5 * 365.25 * 86400).interval(600) == MAX_INTERVAL
    custom = Daly(M, min_interval=10, max_interval=100)
    assert custom.interval(0.001) == 10
    assert custom.interval(300) == 100
    with pytest.raises(ValueError, match="min_interval"):
        Daly(M, min_interval=100, max_interval=10)
    with pytest.raises(ValueError, match="MTBF"):
        Young(0)


def test_fixed_ignores_cost():
    policy = Fixed(900)
    assert policy.interval(0.1) == 900 and policy.interval(5000) == 900
    assert policy.due(899.9, 1.0) is False
    assert policy.due(900, 1.0) is True
    with pytest.raises(ValueError, match="fixed interval"):
        Fixed(0)


def test_every_steps():
    policy = EverySteps(10)
    assert policy.due_at_step(9, None) is False
    assert policy.due_at_step(10, None) is True
    # after a restart from step 1003, the next save is due at 1013, not 1010
    assert policy.due_at_step(1010, 1003) is False
    assert policy.due_at_step(1013, 1003) is True
    assert policy.due(1e9, 1.0, step=1005, last_saved_step=1003) is False  # never time-due
    assert policy.due(0.0, 1.0, step=1013, last_saved_step=1003) is True
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="every_steps"):
            EverySteps(bad)


def test_base_policy_is_never_due():
    policy = IntervalPolicy()
    assert policy.due(1e12, 1.0, step=10**9, last_saved_step=0) is False


def test_time_policy_due():
    policy = Daly(M)
    assert policy.due(4893.0, 300) is False
    assert policy.due(4894.0, 300) is True


def test_make_policy():
    assert isinstance(make_policy("daly", mtbf=M), Daly)
    assert isinstance(make_policy(" Young ", mtbf=M), Young)
    assert make_policy("fixed", interval=60).interval(1) == 60
    assert make_policy("steps", every_steps=5).due_at_step(5, 0)
    assert make_policy("daly", mtbf=M, min_interval=1).interval(0.0) == 1
    with pytest.raises(ValueError, match="MTBF"):
        make_policy("daly")
    with pytest.raises(ValueError, match="interval="):
        make_policy("fixed", mtbf=M)
    with pytest.raises(ValueError, match="every_steps"):
        make_policy("steps")
    with pytest.raises(
        ValueError, match=r"unknown interval policy 'dali'.*young, daly, fixed, steps"
    ):
        make_policy("dali", mtbf=M)


def test_initial_cost_estimate():
    assert DEFAULT_BANDWIDTH == 1e9
    assert initial_cost_estimate(0) == 1.0
    assert initial_cost_estimate(20e9) == pytest.approx(21.0)
    assert initial_cost_estimate(1e9, bandwidth=1e8, latency=0) == pytest.approx(10.0)
    with pytest.raises(ValueError, match="bandwidth"):
        initial_cost_estimate(1, bandwidth=0)
    with pytest.raises(ValueError, match="state size"):
        initial_cost_estimate(-1)


def steady(tracker, value, times):
    for _ in range(times):
        tracker.add(value)


def test_cost_tracker_starts_empty():
    tracker = CostTracker()
    assert tracker.estimate is None
    assert tracker.get(7.0) == 7.0
    assert tracker.add(12.0) == 12.0
    assert tracker.estimate == 12.0 and tracker.count == 1 and tracker.last == 12.0


def test_cost_tracker_ignores_a_single_outlier():
    tracker = CostTracker()
    steady(tracker, 100.0, 10)
    after_spike = tracker.add(1000.0)  # one save ten times slower
    assert after_spike <= 150.0  # at most +50 %: the interval grows by <= 22 %
    assert Daly(M).interval(after_spike) / Daly(M).interval(100.0) < 1.25
    steady(tracker, 100.0, 4)
    assert tracker.estimate == pytest.approx(100.0, rel=0.05)


def test_cost_tracker_follows_a_sustained_change():
    up = CostTracker()
    steady(up, 100.0, 10)
    estimates = [up.add(1000.0) for _ in range(5)]
    assert estimates[1] < 200.0  # two slow saves are not yet a trend
    assert estimates[4] == pytest.approx(1000.0, rel=0.10)  # five are

    down = CostTracker()
    steady(down, 1000.0, 10)
    estimates = [down.add(100.0) for _ in range(5)]
    assert estimates[4] == pytest.approx(100.0, rel=0.15)


def test_cost_tracker_handles_zero_costs():
    tracker = CostTracker()
    steady(tracker, 0.0, 6)
    assert tracker.estimate == 0.0
    steady(tracker, 5.0, 6)
    assert tracker.estimate == pytest.approx(5.0, rel=0.05)


def test_cost_tracker_validates():
    with pytest.raises(ValueError, match="checkpoint cost"):
        CostTracker().add(-1.0)
    with pytest.raises(ValueError, match="alpha"):
        CostTracker(alpha=0)
    with pytest.raises(ValueError, match="clip"):
        CostTracker(clip=1.0)
    with pytest.raises(ValueError, match="window"):
        CostTracker(window=0)
