"""When the Checkpointer's next checkpoint is due (hpcckpt/coord/schedule.py)."""

from __future__ import annotations

import pytest

from hpcckpt.coord.levels import Levels
from hpcckpt.coord.options import LevelOptions, ScheduleOptions
from hpcckpt.coord.schedule import Schedule
from hpcckpt.policy import initial_cost_estimate


def make(cached: bool = False, levels: LevelOptions | None = None, **given) -> Schedule:
    return Schedule(ScheduleOptions(**given), 1, Levels(levels or LevelOptions()), cached)


def test_every_steps_alone_has_no_interval_and_counts_from_zero() -> None:
    s = make(every_steps=10)
    assert s.policy is None and s.interval is None
    assert s.describe() == "every 10 steps"
    assert [k for k in range(35) if s.steps_due(k)] == [9, 19, 29]


def test_a_fixed_interval_stays_whatever_the_costs() -> None:
    s = make(interval=30)
    s.costs.add(5.0)
    assert s.interval == pytest.approx(30.0)
    assert "30" in s.describe() and not s.steps_due(9)


def test_daly_follows_the_measured_cost_and_the_deadline_plans_with_the_durable_one() -> None:
    s = make(mtbf="1d")
    first = s.interval
    s.costs.add(60.0)
    assert s.interval > first  # a dearer checkpoint: further apart
    s.durable_costs.add(90.0)
    assert s.cost_estimate == pytest.approx(60.0) and s.durable_cost_estimate == pytest.approx(90.0)


def test_the_first_cost_is_sized_once_from_the_state_unless_given() -> None:
    s = make(mtbf="1d")
    assert s.needs_size
    s.size_first_cost(8 << 30)
    assert not s.needs_size and s.cost_estimate == pytest.approx(initial_cost_estimate(8 << 30))
    s.size_first_cost(1)  # a later size changes nothing
    assert s.cost_estimate == pytest.approx(initial_cost_estimate(8 << 30))
    given = make(mtbf="1d", initial_cost=7)
    assert not given.needs_size and given.cost_estimate == pytest.approx(7.0)


def test_two_levels_plan_only_with_a_cache_and_drain_every_auto() -> None:
    auto = LevelOptions(drain_every="auto")
    assert make(mtbf="1d", levels=auto).level_plan() is None  # no node-local tier
    s = make(cached=True, levels=auto, mtbf="1d")
    s.costs.add(2.0)
    s.durable_costs.add(200.0)
    plan = s.level_plan()
    assert plan is not None and plan.drain_every > 1
    assert s.interval == pytest.approx(plan.interval)
    assert make(cached=True, levels=LevelOptions(drain_every=3), mtbf="1d").level_plan() is None
