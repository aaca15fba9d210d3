"""hpcckpt.job.endstop: when the wrapper requests the stop before the job's end time."""

import time

import pytest

from hpcckpt.job import endstop


def test_default_cost_before_any_measurement():
    plan = endstop.plan(10_000.0, [])
    assert not plan.measured and plan.cost == endstop.DEFAULT_COST
    assert plan.stop_at == pytest.approx(10_000 - 20 * 1.5 - 20)  # 50 s before the end
    assert "default" in plan.describe()


def test_measured_cost_wins_and_the_signal_lead_moves_it_earlier():
    history = [{"event": "restart_set", "seconds": 10.0}, {"event": "checkpoint", "seconds": 4.0}]
    plan = endstop.plan(10_000.0, history)
    assert plan.measured and plan.stop_at == pytest.approx(10_000 - 15 - 20)
    early = endstop.plan(10_000.0, history, signal_lead=30)
    assert early.stop_at == pytest.approx(10_000 - 30 - endstop.SIGNAL_SLACK - 15 - 20)
    assert "B: signal" in early.describe()


def test_end_stop_fires_once_when_due():
    stop = endstop.EndStop(lambda: time.time() + 50.5, lambda: [], default_cost=0.0)
    stop.start()
    deadline = time.monotonic() + 5
    while stop.plan is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stop.plan is not None and not stop.due()  # 30.5 s left before its stop time
    assert stop.due(stop.plan.stop_at + 0.1) and not stop.due(stop.plan.stop_at + 1)


def test_end_stop_without_end_time_or_with_failure():
    stop = endstop.EndStop(lambda: None, lambda: [])
    stop._load()
    assert stop.plan is None and "no end time" in stop.error and not stop.due()

    def broken() -> float:
        raise RuntimeError("squeue not found")

    stop = endstop.EndStop(broken, lambda: [])
    stop._load()
    assert stop.error == "squeue not found"
