"""Per-rank heartbeats (hpcckpt/rundir/heartbeat.py): rate-limited writes, tolerant reads."""

from __future__ import annotations

import threading
import time

from hpcckpt.rundir import heartbeat
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
    assert w.flush(10)
    w.beat(2)  # within the period: not written
    assert w.flush(10)
    assert read_heartbeats(tmp_path)[1].step == 1
    w.beat(3, phase="save", force=True)
    assert w.flush(10)
    beat = read_heartbeats(tmp_path)[1]
    assert (beat.step, beat.phase) == (3, "save")
    w.close()


def test_beats_are_written_by_the_writers_thread_and_close_writes_the_newest(tmp_path, monkeypatch):
    writers: list[str] = []
    real = heartbeat.write_heartbeat

    def observed(directory, beat):
        writers.append(threading.current_thread().name)
        real(directory, beat)

    monkeypatch.setattr(heartbeat, "write_heartbeat", observed)
    before = set(threading.enumerate())
    w = HeartbeatWriter(tmp_path, rank=0, period=0)
    for step in range(50):
        w.beat(step, force=True)
    w.beat(50, "finished", force=True)
    w.close()
    beat = read_heartbeats(tmp_path)[0]
    assert (beat.step, beat.phase) == (50, "finished")  # the newest, written before close returned
    assert writers and set(writers) == {"hpcckpt-heartbeat"}  # never the caller's thread
    assert len(writers) <= 51
    assert not set(threading.enumerate()) - before  # its thread ended
    w.beat(51, "compute", force=True)  # after close: written at once, by the caller
    assert read_heartbeats(tmp_path)[0].step == 51
    assert writers[-1] == threading.current_thread().name


def test_a_beat_is_written_within_the_lag_without_a_flush(tmp_path):
    """beat() never wakes the thread: it finds the beat within WRITE_LAG by itself."""
    w = HeartbeatWriter(tmp_path, rank=2, period=0)
    try:
        for step in (1, 2):
            w.beat(step, "save", force=True)
            end = time.monotonic() + 30
            while (b := read_heartbeats(tmp_path).get(2)) is None or b.step != step:
                assert time.monotonic() < end, f"beat {step} never written"
                time.sleep(0.01)
    finally:
        w.close()


def test_a_heartbeat_folder_that_cannot_be_written_never_stops_the_rank(tmp_path):
    (tmp_path / "file").write_text("")
    w = HeartbeatWriter(tmp_path / "file", rank=0)  # a file where the folder should be
    w.beat(1, force=True)
    assert w.flush(10)  # the thread survived the error and took the beat
    w.beat(2, force=True)
    assert w.flush(10)
    w.close()


def test_unreadable_files_are_skipped_and_clear_forgets(tmp_path):
    write_heartbeat(tmp_path, Heartbeat(0, 5, 1000.0))
    (heartbeat_dir(tmp_path) / "rank-9.json").write_text("{")
    assert list(read_heartbeats(tmp_path)) == [0]
    clear_heartbeats(tmp_path)
    assert read_heartbeats(tmp_path) == {}
    assert read_heartbeats(tmp_path / "none") == {}
