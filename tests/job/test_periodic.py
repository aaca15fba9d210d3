"""The periodic checkpoint signal's schedule (hpcckpt/job/periodic.py)."""

from __future__ import annotations

import pytest

from hpcckpt.job.periodic import PeriodicSchedule


def test_periodic_schedule():
    fixed = PeriodicSchedule("30s", start=100.0)
    assert fixed.interval() == 30 and fixed.next_at() == 130 and not fixed.due(129)
    fixed.checkpointed(140.0, 2.0)
    assert fixed.next_at() == 170
    history = [{"event": "restart_set", "seconds": 50.0}]
    auto = PeriodicSchedule("auto", start=0.0, mtbf="12h", history=history)
    assert auto.interval() == pytest.approx((2 * 50 * 43200) ** 0.5)


def test_exported_interval_is_fitted_to_the_time_left():
    """cost 10 s, 1 node, default MTBF: Young says over 15 h; a 1 h job exports what lets
    it write before its end-time stop, and without a known end time the plain interval."""
    history = [{"event": "restart_set", "seconds": 10.0}]
    schedule = PeriodicSchedule("auto", start=0.0, nodes=1, history=history)
    assert schedule.interval() > 15 * 3600
    stop_in = 3600 - 10 * 1.5 - 20
    assert schedule.exported(stop_in) == round(stop_in * 0.9 - 10)
    assert schedule.exported(None) == round(schedule.interval())
    fixed = PeriodicSchedule("10min", start=0.0)
    assert fixed.exported(stop_in) <= 600 and fixed.exported(None) == 600
