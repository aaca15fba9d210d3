"""The report's node failures (hpcckpt/report/nodes.py)."""

from __future__ import annotations

import pytest

from hpcckpt.report import analyze, format_report


def ev(t, kind, **f):
    return {"time": 1000.0 + t, "event": kind, **f}


def test_report_shows_the_node_failure_and_its_cost():
    a, b = {"attempt": "a", "restart": 0}, {"attempt": "b", "restart": 1}
    ck = {"source": "checkpointer"}
    events = [
        ev(0, "wrapper_start", **a),
        ev(1, "start", **a, **ck),
        ev(2, "restore", step=None, **a, **ck),
        ev(10, "checkpoint", step=9, seconds=0.1, **a, **ck),
        ev(30, "node_failure", node="n2", action="requeued_by_slurm", detected="signal", **a),
        ev(30, "requeue", cause="node_failure", by="slurm", **a),
        ev(31, "step_end", outcome="crashed", **a),
        ev(50, "wrapper_start", **b),
        ev(51, "start", **b, **ck),
        ev(52, "restore", step=9, **b, **ck),
        ev(60, "finish", last_step=19, **b, **ck),
        ev(61, "step_end", outcome="finished", **b),
        ev(61, "finished", **b),
    ]
    r = analyze(events)
    assert r["unknown_events"] == {}
    assert r["attempts"][0]["outcome"] == "crashed"
    (f,) = r["node_failures"]
    assert f["node"] == "n2" and f["attempt"] == 1
    assert f["lost_seconds"] == pytest.approx(20.0) and f["queue_seconds"] == pytest.approx(19.0)
    assert "node n2 failed at" in format_report(r) and "requeued by Slurm" in format_report(r)
