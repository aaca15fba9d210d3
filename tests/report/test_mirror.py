"""The mirror's part of ``hpcckpt report``: copied, behind, failures, the last wait."""

from __future__ import annotations

from hpcckpt.report.analysis import analyze
from hpcckpt.report.mirror import analyze_mirror, format_mirror
from hpcckpt.report.text import format_report

URL = "s3://bucket/run"


def ck(step: int, **extra) -> dict:
    return {"event": "checkpoint", "step": step, "time": 100.0 + step, **extra}


def mirrored(step: int, size: int = 2_000_000, rate: float = 4e6) -> dict:
    return {"event": "mirrored", "step": step, "time": 101.0 + step, "bytes": size,
            "rate": rate, "mirror": URL}  # fmt: skip


def test_no_mirror_events_is_none_and_no_lines():
    assert analyze_mirror([ck(1), ck(2)]) is None
    assert format_mirror(None) == []


def test_up_to_date_when_the_newest_committed_checkpoint_is_mirrored():
    m = analyze_mirror([ck(10), mirrored(10), ck(20), mirrored(20, rate=8e6)])
    assert m["mirrored"] == [10, 20] and m["bytes"] == 4_000_000 and m["behind"] == []
    assert m["median_rate"] == 6e6 and m["newest_mirrored"] == 20 and m["mirror"] == URL
    text = "\n".join(format_mirror(m))
    assert "2 checkpoint(s) copied and verified, 4.0 MB, median 6.0 MB/s; newest step 20" in text
    assert "up to date" in text


def test_behind_lists_the_committed_steps_newer_than_the_newest_mirrored():
    events = [ck(10), mirrored(10), ck(20), ck(30), ck(40, tier="cache")]
    events.append({"event": "mirror_failed", "step": 20, "reason": "connection refused",
                   "attempt": 3, "retry_in": 4.0, "mirror": URL})  # fmt: skip
    m = analyze_mirror(events)
    assert m["behind"] == [20, 30]  # the node-local-only step 40 is not the mirror's
    assert m["failures"] == 1 and m["last_failure"] == {"step": 20, "reason": "connection refused"}
    text = "\n".join(format_mirror(m))
    assert "behind: 2 committed checkpoint(s) not on the mirror, steps 20, 30" in text
    assert "1 failed cop(ies); the last, step 20: connection refused" in text


def test_nothing_mirrored_yet_is_all_behind_and_a_failed_wait_says_so():
    events = [ck(5), {"event": "mirror_failed", "step": 5, "reason": "full", "mirror": URL}]
    events.append({"event": "mirror_wait", "reason": "finish", "done": False, "seconds": 30.0,
                   "step": 5, "error": "the store is full"})  # fmt: skip
    m = analyze_mirror(events)
    assert m["newest_mirrored"] is None and m["behind"] == [5]
    text = "\n".join(format_mirror(m))
    assert "step 5 did NOT arrive after 30.0 s (the store is full)" in text


def test_pruned_files_are_counted_and_the_report_shows_the_section():
    events = [{"event": "wrapper_start", "time": 100.0, "attempt": "a1"}, ck(1), mirrored(1)]
    events.append({"event": "mirror_pruned", "time": 103.0, "deleted": ["a.h5", "b.h5"],
                   "mirror": URL})  # fmt: skip
    report = analyze(events)
    assert report["mirror"]["pruned"] == 2 and "mirrored" not in report["unknown_events"]
    assert "2 file(s) deleted by the mirror's retention" in format_report(report)
    assert f"Mirror {URL}" in format_report(report)


def test_a_mirror_wait_is_waiting_not_useful_work():
    from tests.report.test_model import ck as cke
    from tests.report.test_model import save

    events = [cke(0, "start", attempt="a"), cke(5, "restore", step=None), *save(15, 1, 2.0)]
    events.append(cke(347, "mirror_wait", step=1, done=False, seconds=300.0, reason="finish",
                      error="refused", mirror=URL))  # fmt: skip
    events.append(cke(348, "finish", step=1, last_step=1))
    report = analyze(events)
    t = report["time"]
    assert t["mirror_wait_seconds"] == 300.0
    assert t["useful_seconds"] == 10.0 + 30.0 + 1.0  # before the save, after it, finish
    total = sum(t[k] for k in ("useful_seconds", "checkpoint_seconds", "overhead_seconds"))
    assert total + t["mirror_wait_seconds"] == t["run_seconds"]
    assert {"kind": "mirror_wait", "start": 47.0, "end": 347.0} in report["attempts"][0]["segments"]
    text = format_report(report)
    assert "waiting for the mirror             5 min (86.2% of run)" in text
    assert "useful work                         41 s (11.8% of run)" in text
    assert report["efficiency"]["run"] < 0.2


def test_behind_counts_only_the_checkpoints_still_in_the_directory():
    events = [ck(s) for s in range(1, 17)]
    events.append({"event": "mirror_failed", "step": 16, "reason": "refused", "count": 40,
                   "since": 5.0, "mirror": URL})  # fmt: skip
    m = analyze_mirror(events, present={14, 15, 16})
    assert m["behind"] == [14, 15, 16] and m["behind_deleted"] == 13
    text = "\n".join(format_mirror(m))
    assert "behind: 3 committed checkpoint(s) not on the mirror, steps 14, 15, 16" in text
    assert "13 more committed checkpoint(s) never reached the mirror" in text
    assert "keeps them" not in text
    assert analyze_mirror(events)["behind_deleted"] is None  # the directory unknown


def test_failures_reported_with_a_count_are_counted_once_each():
    events = [ck(5)]
    for count in (1, 2, 4, 8):
        events.append({"event": "mirror_failed", "step": 5, "reason": "refused", "attempt": count,
                       "count": count, "since": 50.0, "mirror": URL})  # fmt: skip
    events.append({"event": "mirror_failed", "step": 5, "reason": "denied", "count": 1,
                   "since": 90.0, "mirror": URL})  # fmt: skip
    events.append({"event": "mirror_failed", "step": 5, "reason": "old style", "mirror": URL})
    m = analyze_mirror(events)
    assert m["failures"] == 8 + 1 + 1
    assert "10 failed cop(ies); the last, step 5: old style" in "\n".join(format_mirror(m))
