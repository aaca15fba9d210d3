"""The end-time rule of applications that take no signal (hpcckpt/job/ownlead.py)."""

from __future__ import annotations

import pytest

from hpcckpt.job import ownlead
from hpcckpt.job.ownlead import Measured


def test_the_lead_counts_what_killwait_does_not_give():
    assert Measured(kill_wait=30).lead() == ownlead.SLACK  # the requeue fits in KillWait
    # no KillWait known: take-down 2 s + requeue 5 s (default) + 5 s
    assert Measured().lead() == pytest.approx(12.0)
    assert Measured(requeue=1.0, kill_wait=1.0).lead() == pytest.approx(7.0)
    assert "KillWait 30 s, requeue 5 s, take-down 2 s" in Measured(kill_wait=30).describe()


def test_numbers_come_from_the_events_and_this_runs_writes():
    history = [
        {"event": "restart_set", "attempt": "a", "began": 100.0, "ended": 101.0},
        {"event": "restart_set", "attempt": "a", "began": 115.0, "ended": 116.5},
        {"event": "restart_set", "attempt": "b", "began": 500.0, "ended": 501.0},
        {"event": "restart_set", "attempt": "c", "seconds": 1.0},  # app-signal: no began
    ]
    m = ownlead.measured(history, [(600.0, 601.0), (616.0, 617.0)], kill_wait=10)
    assert m.period == pytest.approx(15.5)  # 15 and 16, never across runs (500 -> 600)
    assert m.duration == pytest.approx(1.5)
    assert m.kill_wait == 10 and m.lead() == ownlead.SLACK
    assert ownlead.measured([]).period is None


def decide(now, m, **kw):
    args = {"settle": 2.0, "step_started": 0.0, "last_write_end": None, "writing_since": None}
    return ownlead.decide(now, 60.0, m, **{**args, **kw})


def test_never_before_the_first_write_when_nothing_says_it_cannot_come():
    m = Measured(kill_wait=10)  # lead 5 s: the latest stop at 55 s
    assert decide(9.5, m) is None  # the loop of the default 20 s "cost": gone
    assert decide(54.0, m) is None
    got = decide(55.0, m)
    assert got is not None and got.lost == 55.0 and "the latest stop" in got.why


def test_right_after_a_complete_write_when_the_next_cannot_end_in_time():
    m = Measured(period=15.0, duration=1.0, kill_wait=10)
    # write ended at 31 s: the next known complete at 31 + 18.75 + 2 + 1 = 52.75 < 55
    assert decide(33.0, m, last_write_end=31.0) is None
    got = decide(48.0, m, last_write_end=46.0)  # next at 67.75: after the latest stop
    assert got is not None and got.lost == pytest.approx(2.0)
    assert got.why.startswith("right after a complete write (2 s ago): the next one (every 15.0")


def test_a_write_under_way_at_the_latest_stop_finishes_when_it_can():
    m = Measured(period=15.0, duration=2.0, kill_wait=10)
    assert decide(55.5, m, writing_since=55.0) is None  # ends at 59 s (2 s + settle 2 s)
    got = decide(56.0, m, writing_since=50.0, last_write_end=40.0)  # a slow one
    assert got is None  # 50 + 2 + 2 = 54 <= 60: still can end before the job does
    slow = Measured(period=15.0, duration=9.0, kill_wait=10)
    got = decide(56.0, slow, writing_since=50.0, last_write_end=40.0)
    assert got is not None and "cannot end before the end time" in got.why and got.lost == 16.0


def test_a_write_far_longer_than_measured_is_not_waited_for():
    m = Measured(period=15.0, duration=1.0, kill_wait=10)
    assert decide(55.0, m, writing_since=54.0) is None  # 1 s + settle: ends at 57 s
    got = decide(55.5, m, writing_since=50.0)  # 5.5 s for a 1 s write: overrun
    assert got is not None and "far longer than the writes measured" in got.why
