"""The wrapper's side of the poisoned-state guard (hpcckpt/job/poison.py)."""

from __future__ import annotations

from hpcckpt.job.outcome import Outcome, StepResult
from hpcckpt.job.poison import classify_poisoned, rejection_of


def test_poisoned_outcome_is_decided_from_this_attempts_rejected_event():
    crashed = StepResult(Outcome.CRASHED, 1, None, "exit status 1")
    evs = [
        {"event": "rejected", "attempt": "old", "step": 3, "ranks": [0]},
        {"event": "rejected", "attempt": "me", "step": 9, "ranks": [1], "arrays": ["u"]},
    ]
    assert rejection_of(evs, "me")["step"] == 9
    result, rej = classify_poisoned(crashed, evs, "me")
    assert result.outcome is Outcome.POISONED and rej["ranks"] == [1]
    assert "rank(s) 1" in result.reason and "'u'" in result.reason
    assert classify_poisoned(crashed, evs[:1], "me")[0] is crashed
    stopped = StepResult(Outcome.STOPPED, 0, None, "stopped")
    assert classify_poisoned(stopped, evs, "me")[0] is stopped
