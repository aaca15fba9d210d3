"""The report as text (hpcckpt/report/text.py)."""

from __future__ import annotations

from hpcckpt.report import analyze, format_report


def test_empty() -> None:
    r = analyze([])
    assert r["attempts"] == [] and r["efficiency"] == {"run": None, "wall": None}
    assert "no job attempt" in format_report(r)


def test_steps_restored_reached_and_saved() -> None:
    """The finish event's step is how far the run got; the saved step can be older."""
    from tests.report.test_model import ck, ev, save

    events = [
        ev(0, "wrapper_start", attempt="a"),
        ck(1, "start"),
        ck(2, "restore", step=None),
        *save(10, 1729, 1.0),
        ev(20, "step_end", attempt="a", outcome="crashed", exit_code=-9),
        ev(20, "crashed", attempt="a", exit_code=-9),
        ev(30, "wrapper_start", attempt="b"),
        ck(31, "start"),
        ck(32, "restore", step=1729),
        ck(60, "finish", step=1999, last_step=1729),
        ev(61, "step_end", attempt="b", outcome="finished"),
        ev(61, "finished", attempt="b"),
    ]
    text = format_report(analyze(events))
    lines = text.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("#"))
    at = lines.index(header)
    assert "  restored  reached    saved ckpts" in header
    assert "       new        ?     1729     1 " in lines[at + 1]  # crashed: how far, unknown
    assert "      1729     1999     1729     0 " in lines[at + 2]  # ran to 1999, saved 1729


def test_a_job_given_up_for_no_progress_says_why() -> None:
    from tests.report.test_model import ev

    reason = "giving up: 3 runs in a row ended before the application wrote a restart set"
    events = [
        ev(0, "wrapper_start", attempt="a"),
        ev(60, "step_end", attempt="a", outcome="stopped"),
        ev(60, "requeue", attempt="a", cause="stop", progress=False),
        ev(70, "wrapper_start", attempt="b"),
        ev(130, "step_end", attempt="b", outcome="stopped"),
        ev(130, "give_up", attempt="b", cause="no_progress", reason=reason),
    ]
    r = analyze(events)
    assert r["gave_up"] == {"cause": "no_progress", "reason": reason, "attempt": "b"}
    text = format_report(r)
    assert "Not continued (runs in a row stopped before keeping anything new)" in text
    assert reason in text
    assert analyze(events[:3])["gave_up"] is None
