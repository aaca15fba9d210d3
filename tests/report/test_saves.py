"""The report's blocked time and peak memory per save, from the checkpoint events."""

from __future__ import annotations

from hpcckpt import report
from hpcckpt.report import saves as report_saves

MiB = 1 << 20


def events() -> list[dict]:
    base = {"source": "checkpointer", "nranks": 2, "restart_count": 0}
    return [
        {**base, "event": "start", "time": 0.0, "policy": "every 1 steps"},
        {**base, "event": "checkpoint_begin", "time": 1.0, "step": 0},
        {**base, "event": "staging_refused", "time": 1.0, "step": 0, "reason": "short"},
        {
            **base,
            "event": "checkpoint",
            "time": 3.0,
            "step": 0,
            "seconds": 2.0,
            "bytes": 10,
            "peak_rss": 900 * MiB,
        },
        {**base, "event": "checkpoint_begin", "time": 4.0, "step": 1},
        {**base, "event": "checkpoint_staged", "time": 4.5, "step": 1, "blocked_seconds": 0.5},
        {
            **base,
            "event": "checkpoint",
            "time": 6.0,
            "step": 1,
            "seconds": 2.0,
            "bytes": 10,
            "blocked_seconds": 0.5,
            "peak_rss": 1200 * MiB,
            "staging_mode": "pieces",
            "staging_bytes": 256 * MiB,
        },
        {**base, "event": "finish", "time": 7.0},
    ]


def test_blocked_time_and_peak_memory_per_save() -> None:
    saves = report_saves.summarize(events())
    assert saves == {
        "blocked_mean_seconds": 1.25,  # 2.0 synchronous, 0.5 staged
        "blocked_max_seconds": 2.0,
        "peak_rss_max_bytes": 1200 * MiB,
        "staging_modes": {"pieces": 1},
        "staging_refused": 1,
    }


def test_the_report_shows_them() -> None:
    rep = report.analyze(events())
    assert rep["checkpoints"]["saves"]["peak_rss_max_bytes"] == 1200 * MiB
    assert "staging_refused" not in rep["unknown_events"]
    text = report.format_report(rep)
    assert "ranks blocked per save: mean 1.25 s, max 2 s" in text
    assert "peak memory of a rank during a save 1.2 GiB" in text
    assert "staged in memory: pieces 1" in text
    assert "1 async save(s) written synchronously: memory short" in text


def test_no_line_without_checkpoints() -> None:
    assert report_saves.format_lines(report_saves.summarize([])) == []
