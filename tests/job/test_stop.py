"""The stop request (hpcckpt/job/stop.py): requested -> held -> forwarded, once."""

from __future__ import annotations

import time

from hpcckpt.job.stop import StopRequest


def test_a_request_is_held_then_forwarded_once():
    stop = StopRequest()
    assert not stop.requested and not stop.under_way
    before = time.monotonic()
    stop.request("USR1")
    assert stop.requested and stop.under_way and stop.name == "USR1"
    assert abs(stop.requested_wall - time.time()) < 1.0 and stop.requested_at >= before
    stop.hold()
    assert not stop.under_way  # held: a repeated signal is told apart from a new one
    stop.forward()
    assert stop.forwarded and stop.under_way and not stop.held


def test_a_request_from_start_up_keeps_its_time_and_can_be_dropped():
    stop = StopRequest()
    stop.request("TERM", at=time.monotonic() - 5.0)
    assert stop.held_for(0.0) >= 5.0
    assert time.time() - stop.requested_wall >= 5.0
    stop.hold()
    stop.drop()
    assert not stop.held and not stop.forwarded
