"""The report's analysis (hpcckpt/report/analysis.py): attempts, checkpoints, lost time and
efficiency from event lists, and real event logs of earlier runs."""

from __future__ import annotations

import json
import math

import pytest

from hpcckpt.policy.formulas import daly, young
from hpcckpt.report import analyze, format_report, load_events
from tests.report.test_model import DATA, ck, ev, save, wrapped_job


def test_attempts_outcomes_and_waits() -> None:
    r = analyze(wrapped_job())
    atts = r["attempts"]
    assert [a["outcome"] for a in atts] == ["crashed", "stopped", "finished"]
    assert [a["job_id"] for a in atts] == ["7", "7", "7"]
    assert [a["restart_count"] for a in atts] == [0, 1, 2]
    assert [a["start"] for a in atts] == [0.0, 160.0, 400.0]
    assert [a["duration"] for a in atts] == [100.0, 60.0, 70.0]
    assert [a["wait_before"] for a in atts] == [None, 60.0, 180.0]
    assert [a["restored_step"] for a in atts] == [None, 20, 35]
    assert [a["last_saved_step"] for a in atts] == [20, 35, 45]
    assert [a["checkpoints"] for a in atts] == [2, 2, 1]
    assert atts[1]["stop_reason"] == "signal SIGUSR1"
    assert atts[1]["requeued"] is True
    assert all(a["end_known"] for a in atts)


def test_lost_time_and_efficiency() -> None:
    r = analyze(wrapped_job())
    a1, a2, a3 = r["attempts"]
    assert a1["seconds"]["lost"] == pytest.approx(31.0)  # 69..100
    assert a2["seconds"]["lost"] == 0 and a3["seconds"]["lost"] == 0
    assert a1["segments"][-1] == {"kind": "lost", "start": 69.0, "end": 100.0}
    t = r["time"]
    assert t["run_seconds"] == pytest.approx(230.0)
    assert t["wall_seconds"] == pytest.approx(470.0)
    assert t["queue_seconds"] == pytest.approx(240.0)
    assert t["lost_seconds"] == pytest.approx(31.0)
    assert t["checkpoint_seconds"] == pytest.approx(10.0)
    # useful: 30+30 | 30+13 | 30+18 ; overhead: 5 | 10+3 | 10+10
    assert t["useful_seconds"] == pytest.approx(151.0)
    assert t["overhead_seconds"] == pytest.approx(38.0)
    total = sum(t[k] for k in ("useful_seconds", "checkpoint_seconds", "overhead_seconds"))
    assert total + t["lost_seconds"] == pytest.approx(t["run_seconds"])
    assert r["efficiency"]["run"] == pytest.approx(151 / 230, abs=1e-4)
    assert r["efficiency"]["wall"] == pytest.approx(151 / 470, abs=1e-4)


def test_queue_segment_is_on_the_row_of_the_attempt_that_waited() -> None:
    r = analyze(wrapped_job())
    first = r["attempts"][2]["segments"][0]
    assert first == {"kind": "queue", "start": 220.0, "end": 400.0}


def test_checkpoint_statistics() -> None:
    events = wrapped_job()
    for e in events:  # vary the costs: 2, 2, 2, 2, 2 -> set one to 6
        if e["event"] == "checkpoint" and e["step"] == 30:
            e["seconds"] = 6.0
    r = analyze(events)
    c = r["checkpoints"]
    assert c["count"] == 5
    assert c["mean_seconds"] == pytest.approx(14 / 5)
    assert c["max_seconds"] == 6.0
    assert c["total_bytes"] == 5000
    assert c["by_reason"] == {"interval": 4, "signal": 1}
    assert c["by_kind"] is None


def test_checkpoint_kinds_counted_when_present() -> None:
    events = [
        ck(0, "start"),
        ck(1, "restore", step=None),
        *save(10, 1, 1.0, kind="full"),
        *save(20, 2, 0.5, kind="incremental"),
        *save(30, 3, 0.5, kind="incremental"),
        ck(40, "finish", last_step=3),
    ]
    assert analyze(events)["checkpoints"]["by_kind"] == {"full": 1, "incremental": 2}


def test_failures_mtbf_and_young_daly() -> None:
    r = analyze(wrapped_job())
    assert r["failures"]["count"] == 1  # the signal stop is not a failure
    assert r["failures"]["mtbf_seconds"] == pytest.approx(230.0)
    iv = r["interval"]
    # regular checkpoints only: 5->35, 37->67, 170->200, 410->440; not the signal one
    assert iv["used_seconds"] == pytest.approx(30.0)
    assert iv["cost_seconds"] == pytest.approx(2.0)
    assert iv["young_seconds"] == pytest.approx(young(2.0, 230.0), abs=1e-3)
    assert iv["daly_seconds"] == pytest.approx(daly(2.0, 230.0), abs=1e-3)
    assert 0 < iv["model_efficiency_used"] <= iv["model_efficiency_daly"] < 1


def test_no_failure_observed() -> None:
    events = [e for e in wrapped_job() if e.get("attempt") != "a1"]
    events = [e for e in events if not (e["time"] < 1160)]
    r = analyze(events)
    assert r["failures"] == {
        "count": 0,
        "mtbf_seconds": None,
        "note": "no failure observed",
    }
    assert r["interval"]["young_seconds"] is None
    assert r["interval"]["young_lower_bound_seconds"] == pytest.approx(
        math.sqrt(2 * 2.0 * 130.0), abs=1e-3
    )
    assert "no failure observed" in format_report(r)


def test_crash_without_wrapper_is_unrecorded_then_resumed() -> None:
    """mpirun app (no wrapper) dies after its checkpoint at 40; rerun by hand at 100."""
    events = [
        ck(0, "start"),
        ck(1, "restore", step=None),
        *save(20, 10, 1.0, reason="steps"),
        *save(40, 20, 1.0, reason="steps"),
        ck(100, "start"),
        ck(102, "restore", step=20),
        *save(122, 30, 1.0, reason="steps"),
        ck(130, "finish", last_step=30),
    ]
    r = analyze(events)
    a1, a2 = r["attempts"]
    assert a1["outcome"] == "crashed" and a1["end_known"] is False
    assert a1["segments"][-1] == {"kind": "unrecorded", "start": 41.0, "end": 100.0}
    assert a2["wait_before"] is None  # unknown: the first attempt's end was not recorded
    assert a2["outcome"] == "finished"
    assert r["time"]["unrecorded_seconds"] == pytest.approx(59.0)
    assert r["time"]["run_seconds"] == pytest.approx(41.0 + 30.0)
    assert r["failures"]["count"] == 1
    assert "end not recorded" in format_report(r)


def test_last_attempt_without_end_is_unknown_not_a_failure() -> None:
    events = [ck(0, "start"), ck(1, "restore", step=None), *save(20, 10, 1.0)]
    r = analyze(events)
    assert r["attempts"][0]["outcome"] == "unknown"
    assert r["failures"]["count"] == 0
    assert r["time"]["lost_seconds"] == 0


def test_relaunch_inside_one_wrapper_attempt_counts_a_failure() -> None:
    events = [
        ev(0, "wrapper_start", attempt="w"),
        ck(1, "start"),
        ck(2, "restore", step=None),
        *save(12, 5, 1.0),
        ev(20, "relaunch", attempt="w", reason="a rank died"),  # known since issue 11
        ck(25, "start"),
        ck(27, "restore", step=5),
        *save(37, 9, 1.0),
        ck(40, "finish", last_step=9),
        ev(41, "step_end", attempt="w", outcome="finished"),
        ev(41, "finished", attempt="w"),
    ]
    r = analyze(events)
    (a,) = r["attempts"]
    assert a["launches"] == 2 and a["outcome"] == "finished"
    assert a["failures"] == 1 and r["failures"]["count"] == 1
    assert a["seconds"]["lost"] == pytest.approx(12.0)  # 13..25
    assert r["unknown_events"] == {}


def test_checkpoint_begun_never_committed_is_lost() -> None:
    events = [
        ev(0, "wrapper_start", attempt="w"),
        ck(1, "start"),
        ck(2, "restore", step=None),
        *save(12, 5, 1.0),
        ck(20, "checkpoint_begin", step=9, reason="interval"),
        ev(30, "step_end", attempt="w", outcome="crashed", exit_code=1),
        ev(30, "crashed", attempt="w", exit_code=1),
    ]
    r = analyze(events)
    assert r["attempts"][0]["seconds"]["lost"] == pytest.approx(17.0)  # 13..30
    assert r["checkpoints"]["uncommitted"] == 1


def test_staged_saves_block_until_staging_and_protect_work_once_committed() -> None:
    events = [
        ev(0, "wrapper_start", attempt="w"),
        ck(1, "start"),
        ck(2, "restore", step=None),
        ck(10, "checkpoint_begin", step=5, reason="interval"),
        ck(10.5, "checkpoint_staged", step=5, blocked_seconds=0.5),
        ck(13.5, "checkpoint", step=5, seconds=3.5, blocked_seconds=0.5, reason="interval"),
        ck(20, "checkpoint_begin", step=9, reason="interval"),
        ck(20.5, "checkpoint_staged", step=9, blocked_seconds=0.5),
        ev(30, "step_end", attempt="w", outcome="crashed", exit_code=1),
        ev(30, "crashed", attempt="w", exit_code=1),
    ]
    r = analyze(events)
    secs = r["attempts"][0]["seconds"]
    assert secs["checkpoint"] == pytest.approx(0.5)  # only the time the ranks were blocked
    assert secs["lost"] == pytest.approx(19.5)  # after step 5 was staged (10.5), to the crash
    assert r["checkpoints"]["uncommitted"] == 1  # step 9: staged, never committed
    assert r["attempts"][0]["last_saved_step"] == 5


def test_time_in_save_splits_into_the_store_and_around_it() -> None:
    events = [
        ev(0, "wrapper_start", attempt="w"),
        ck(1, "start"),
        ck(2, "restore", step=None),
        ck(10, "checkpoint_begin", step=5, reason="interval"),  # 1 s in the store, 0.5 around
        ck(11.5, "checkpoint", step=5, seconds=1.0, reason="interval"),
        ck(20, "checkpoint_begin", step=9, reason="interval"),  # staged: blocked 0.5 s of 0.75
        ck(20.75, "checkpoint_staged", step=9, blocked_seconds=0.5),
        ck(23, "checkpoint", step=9, seconds=3.0, blocked_seconds=0.5, reason="interval"),
        ck(30, "finish", step=12, last_step=9),
        ev(31, "step_end", attempt="w", outcome="finished"),
        ev(31, "finished", attempt="w"),
    ]
    t = analyze(events)["time"]
    assert t["checkpoint_seconds"] == pytest.approx(2.25)
    assert t["checkpoint_store_seconds"] == pytest.approx(1.5)
    assert t["checkpoint_other_seconds"] == pytest.approx(0.75)


def test_a_node_local_save_blocks_until_its_commit_and_no_longer() -> None:
    """A save kept on the node-local tier has a begin and a commit with blocked_seconds but
    no checkpoint_staged: the work after it is compute, not checkpoint time."""
    events = [
        ev(0, "wrapper_start", attempt="w"),
        ck(1, "start"),
        ck(2, "restore", step=None),
        ck(10, "checkpoint_begin", step=5, reason="interval"),
        ck(10.5, "checkpoint", step=5, seconds=0.5, blocked_seconds=0.5, tier="cache"),
        ck(30, "finish", step=12, last_step=5),
        ev(31, "step_end", attempt="w", outcome="finished"),
        ev(31, "finished", attempt="w"),
    ]
    secs = analyze(events)["attempts"][0]["seconds"]
    assert secs["checkpoint"] == pytest.approx(0.5)
    assert secs["compute"] == pytest.approx(8.0 + 19.5)


def test_tolerates_missing_fields_unknown_events_and_garbage() -> None:
    events = [
        {"event": "start"},  # no time: dropped
        {"time": "x", "event": "start"},
        ev(0, "wrapper_start"),  # no attempt token
        ev(1, "start"),  # no source
        ev(2, "restore"),
        ev(5, "checkpoint", step=1),  # no seconds, no bytes, no reason
        ev(6, "an_event_of_a_later_version", budget=3),
        ev(9, "step_end"),  # no outcome: crashed
    ]
    r = analyze(events)
    assert r["events"] == 6
    assert r["unknown_events"] == {"an_event_of_a_later_version": 1}
    assert r["checkpoints"]["count"] == 1 and r["checkpoints"]["mean_seconds"] is None
    assert r["checkpoints"]["by_reason"] == {"unknown": 1}
    assert r["attempts"][0]["outcome"] == "crashed"
    assert r["interval"]["note"] == "no checkpoint cost measured"
    json.dumps(r)
    format_report(r)


def test_real_wrapper_run_crash_stop_finish() -> None:
    """heat2d under `hpcckpt run -- mpirun -n 2`: crash at step 200, USR1, then finish."""
    r = analyze(load_events(DATA / "wrapper_crash_stop_finish.jsonl"))
    assert [a["outcome"] for a in r["attempts"]] == ["crashed", "stopped", "finished"]
    assert [a["restored_step"] for a in r["attempts"]] == [None, 186, 390]
    assert r["checkpoints"]["count"] == 7
    assert r["checkpoints"]["by_reason"] == {"interval": 6, "signal": 1}
    assert r["failures"]["count"] == 1
    assert r["time"]["lost_seconds"] == pytest.approx(2.488, abs=0.01)
    assert r["interval"]["used_seconds"] == pytest.approx(3.0, abs=0.1)
    assert r["interval"]["configured_seconds"] == 3.0
    assert 0.7 < r["efficiency"]["run"] < 0.85


def test_real_slurm_requeue() -> None:
    """make demo on the local Slurm cluster: USR1 from Slurm, requeue, finish."""
    r = analyze(load_events(DATA / "slurm_signal_requeue.jsonl"))
    a1, a2 = r["attempts"]
    assert (a1["job_id"], a1["restart_count"], a2["restart_count"]) == ("1", 0, 1)
    assert a1["outcome"] == "stopped" and a1["requeued"] and a2["outcome"] == "finished"
    assert a2["wait_before"] == pytest.approx(6.0, abs=0.01)
    assert r["failures"]["count"] == 0
    assert r["interval"]["used_seconds"] is None  # only a signal checkpoint


def test_real_crash_without_wrapper() -> None:
    r = analyze(load_events(DATA / "no_wrapper_crash_resume.jsonl"))
    a1, a2 = r["attempts"]
    assert a1["outcome"] == "crashed" and not a1["end_known"]
    assert a2["restored_step"] == 99 and a2["outcome"] == "finished"
    assert r["checkpoints"]["by_reason"] == {"steps": 6}


def test_real_slurm_kill_and_resubmit() -> None:
    """Local Slurm: job 2 signalled and requeued, then a rank SIGKILLed; job 3 resubmitted
    by hand, requeued four times, finished. Checkpointer events carry the attempt token."""
    r = analyze(load_events(DATA / "slurm_kill_resubmit.jsonl"))
    atts = r["attempts"]
    assert [(a["job_id"], a["restart_count"]) for a in atts] == [
        ("2", 0),
        ("2", 1),
        ("3", 0),
        ("3", 1),
        ("3", 2),
        ("3", 3),
        ("3", 4),
    ]
    assert [a["outcome"] for a in atts] == ["stopped", "crashed"] + ["stopped"] * 4 + ["finished"]
    assert all(a["launches"] == 1 for a in atts)
    assert atts[1]["seconds"]["lost"] == pytest.approx(7.21, abs=0.01)
    assert r["checkpoints"]["uncommitted"] == 1  # the rank died during a checkpoint
    assert r["checkpoints"]["by_reason"] == {"interval": 9, "signal": 5}
    assert r["failures"]["count"] == 1
    assert r["interval"]["daly_seconds"] == pytest.approx(11.4, abs=0.1)


def test_array_task_is_named() -> None:
    task = {"job_id": "14", "array_task": "12_2"}
    events = [
        ev(0, "wrapper_start", attempt="a1", **task),
        ck(2, "start", **task),
        ck(3, "restore", step=None, **task),
        *save(10, 5, 1.0),
        ev(20, "step_end", attempt="a1", outcome="finished", step=5, **task),
        ev(20, "finished", attempt="a1", step=5, **task),
    ]
    r = analyze(events)
    assert r["attempts"][0]["array_task"] == "12_2"
    assert "12_2" in format_report(r)
