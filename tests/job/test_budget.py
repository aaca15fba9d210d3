"""The restart budget (hpcckpt/job/budget.py): counting continuations, deciding after a crash."""

from __future__ import annotations

from hpcckpt.job import budget


def ev(kind, restart=0, **fields):
    return {"event": kind, "restart": restart, **fields}


def test_crash_restarts_count_since_the_last_fresh_submission():
    log = [
        ev("wrapper_start", 0),
        ev("requeue", 0, cause="crash"),
        ev("wrapper_start", 1),
        ev("requeue", 1, cause="stop"),
        ev("wrapper_start", 2),
        ev("chain", 2, cause="crash"),
    ]
    assert budget.crash_restarts_used(log) == 2
    assert budget.crash_restarts_used([*log, ev("wrapper_start", 0)]) == 0  # resubmitted


def test_decide_after_crash():
    log = [ev("wrapper_start", 0, attempt="a"), ev("checkpoint", 0, attempt="a", step=40)]
    d = budget.decide_after_crash(log, attempt="a", restart=0, runtime=5, min_progress=60)
    assert d.restart and "checkpoint at step 40" in d.message and "1 of 5" in d.message
    d = budget.decide_after_crash(log, attempt="b", restart=0, runtime=5, min_progress=60)
    assert not d.restart and "before writing any checkpoint" in d.message
    d = budget.decide_after_crash(log, attempt="b", restart=0, runtime=61, min_progress=60)
    assert d.restart and "ran 61 s" in d.message
    spent = [*log, *[ev("requeue", 0, cause="crash")] * 5]
    d = budget.decide_after_crash(spent, attempt="a", restart=5, runtime=999)
    assert not d.restart and "5 restart(s) after crashes already" in d.message
    # an unreadable log counts every earlier restart as a crash
    d = budget.decide_after_crash(None, attempt="a", restart=5, runtime=999)
    assert not d.restart


def test_relaunches_and_node_failure_requeues_count_against_the_budget():
    log = [
        {"event": "wrapper_start", "restart": 0},
        {"event": "relaunch", "cause": "node_failure"},
        {"event": "requeue", "cause": "node_failure", "by": "slurm"},
        {"event": "requeue", "cause": "stop"},
        {"event": "requeue", "cause": "crash"},
    ]
    assert budget.crash_restarts_used(log) == 3
