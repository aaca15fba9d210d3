"""Node-failure helpers without Slurm: hostlists, sinfo states, spare-node planning, budget."""

from __future__ import annotations

import pytest

from hpcckpt import slurm as nodes
from hpcckpt.job import budget, relaunch
from hpcckpt.report import analyze, format_report


@pytest.mark.parametrize(
    "text, expected",
    [
        ("n[1-3]", ["n1", "n2", "n3"]),
        ("n[1,3]", ["n1", "n3"]),
        ("n1", ["n1"]),
        ("gpu[08-10],cpu1", ["gpu08", "gpu09", "gpu10", "cpu1"]),
        ("n[1-2,5],m[1-2]", ["n1", "n2", "n5", "m1", "m2"]),
        ("(null)", []),
        ("", []),
    ],
)
def test_expand_hostlist(text, expected):
    assert nodes.expand_hostlist(text) == expected


def test_failed_states():
    assert all(map(nodes.is_failed, ["down*", "down", "idle*", "fail", "down+drain"]))
    assert not any(map(nodes.is_failed, ["idle", "mixed", "allocated", "completing", ""]))
    assert nodes.parse_sinfo("n1 mixed\nn2 down*\n") == {"n1": "mixed", "n2": "down*"}


def test_spare_planning():
    assert relaunch.step_ranks(3, 3, 2) == 2
    assert relaunch.step_ranks(4, 3, 2) is None
    assert relaunch.choose_nodes(["n1", "n2", "n3"], ["n2"], 2) == ["n1", "n3"]
    assert relaunch.choose_nodes(["n1", "n3"], ["n3"], 2) is None
    cmd = relaunch.srun_command(["srun", "--mpi=pmix", "python", "a.py"], ["n1", "n3"], 2)
    assert cmd == ["srun", "--nodes=2", "--nodelist=n1,n3", "--ntasks=2", "--mpi=pmix",
                   "python", "a.py"]  # fmt: skip
    assert relaunch.placement_args(["-N", "2", "--nodelist=n1", "-w", "x", "-n", "2"]) == [
        "-N",
        "--nodelist=n1",
        "-w",
    ]
    assert relaunch.is_srun(["/usr/bin/srun", "x"], {})
    assert not relaunch.is_srun(["mpirun", "x"], {})


def test_cut_off_attempt():
    log = [
        {"event": "wrapper_start", "attempt": "a", "nodes": "n[1-2]", "time": 1.0},
        {"event": "checkpoint", "attempt": "a", "time": 2.0},
        {"event": "wrapper_start", "attempt": "b", "time": 9.0},
    ]
    assert relaunch.cut_off_attempt(log, "b")["attempt"] == "a"
    log.insert(2, {"event": "step_end", "attempt": "a", "time": 3.0})
    assert relaunch.cut_off_attempt(log, "b") is None


def test_relaunches_and_node_failure_requeues_count_against_the_budget():
    log = [
        {"event": "wrapper_start", "restart": 0},
        {"event": "relaunch", "cause": "node_failure"},
        {"event": "requeue", "cause": "node_failure", "by": "slurm"},
        {"event": "requeue", "cause": "stop"},
        {"event": "requeue", "cause": "crash"},
    ]
    assert budget.crash_restarts_used(log) == 3


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
