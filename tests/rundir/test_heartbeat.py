"""Per-rank heartbeats (hpcckpt/rundir/heartbeat.py): rate-limited writes, tolerant reads."""

from __future__ import annotations

from hpcckpt.rundir.heartbeat import (
    Heartbeat,
    HeartbeatWriter,
    clear_heartbeats,
    heartbeat_dir,
    read_heartbeats,
    write_heartbeat,
)


def test_writer_is_rate_limited_and_forced_beats_go_through(tmp_path):
    w = HeartbeatWriter(tmp_path, rank=1, period=3600)
    w.beat(1)
    w.beat(2)  # within the period: not written
    assert read_heartbeats(tmp_path)[1].step == 1
    w.beat(3, phase="save", force=True)
    beat = read_heartbeats(tmp_path)[1]
    assert (beat.step, beat.phase) == (3, "save")


def test_unreadable_files_are_skipped_and_clear_forgets(tmp_path):
    write_heartbeat(tmp_path, Heartbeat(0, 5, 1000.0))
    (heartbeat_dir(tmp_path) / "rank-9.json").write_text("{")
    assert list(read_heartbeats(tmp_path)) == [0]
    clear_heartbeats(tmp_path)
    assert read_heartbeats(tmp_path) == {}
    assert read_heartbeats(tmp_path / "none") == {}
