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
