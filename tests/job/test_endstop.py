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


def test_end_stop_follows_a_moved_end_time():
    """An administrator shortens the limit mid-run (scontrol update TimeLimit=...): the
    end time is read again and the stop moves with it; a failed reading keeps the plan."""
    ends = [time.time() + 3600.0]

    def fetch() -> float:
        if ends[0] < 0:
            raise RuntimeError("squeue timed out")
        return ends[0]

    stop = endstop.EndStop(fetch, lambda: [], default_cost=0.0, refresh=0.05)
    stop.start()
    try:
        deadline = time.monotonic() + 5
        while stop.plan is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stop.plan is not None and not stop.due()
        shorter = time.time() + 10.0  # now within the 20 s margin
        ends[0] = shorter
        while stop.plan.end != shorter and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stop.plan.end == shorter and stop.due()
        stop.fired = False
        ends[0] = -1.0  # squeue fails once: the last plan stays
        time.sleep(0.2)
        assert stop.plan.end == shorter and stop.error is None
    finally:
        stop.close()


def test_end_stop_disarms_when_the_limit_is_removed():
    ends: list[float | None] = [time.time() + 3600.0]
    stop = endstop.EndStop(lambda: ends[0], lambda: [], refresh=0.05)
    stop._load()
    assert stop.plan is not None
    ends[0] = None
    stop._load()
    assert stop.plan is None and "any more" in stop.error and not stop.due()


def test_end_stop_arms_once_a_failed_first_reading_succeeds():
    """squeue fails at the start (a busy controller): the stop is not armed, but the end
    time is read again and the stop arms when a reading succeeds."""
    answers: list[float | None] = [-1.0]

    def fetch() -> float | None:
        if answers[0] is not None and answers[0] < 0:
            raise RuntimeError("squeue timed out")
        return answers[0]

    stop = endstop.EndStop(fetch, lambda: [], default_cost=0.0, refresh=0.05)
    stop.start()
    try:
        deadline = time.monotonic() + 5
        while stop.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stop.plan is None and stop.error == "squeue timed out" and not stop.due()
        end = time.time() + 3600.0
        answers[0] = end
        while stop.plan is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stop.plan is not None and stop.plan.end == end and stop.error is None
    finally:
        stop.close()


def test_an_end_time_read_before_the_step_is_not_read_again_at_once():
    """The wrapper read the end time for HPCCKPT_INTERVAL just before the step started:
    the stop is planned from that reading, and Slurm is asked again only a refresh later."""
    calls: list[float] = []
    known = time.time() + 3600.0

    def fetch() -> float:
        calls.append(time.monotonic())
        return known - 600.0  # the limit was shortened since

    stop = endstop.EndStop(fetch, lambda: [], default_cost=0.0, refresh=0.3, known_end=known)
    started = time.monotonic()
    stop.start()
    try:
        deadline = started + 5
        while stop.plan is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stop.plan is not None and stop.plan.end == known and not calls
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert calls and calls[0] - started >= 0.3  # the next reading: a refresh later
        while stop.plan.end == known and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stop.plan.end == known - 600.0
    finally:
        stop.close()
