"""hpcckpt.job.ownschedule: sets written on the application's own schedule, real files."""

import time

from hpcckpt.job.ownschedule import OwnScheduleWatch
from hpcckpt.job.restart_files import RestartFiles


def _write(path, data: bytes, pieces: int = 3, pause: float = 0.05) -> None:
    with open(path, "wb") as fh:
        step = len(data) // pieces
        for i in range(pieces):
            fh.write(data[i * step : (i + 1) * step] if i < pieces - 1 else data[i * step :])
            fh.flush()
            time.sleep(pause)


def _tick_until(watch, alive: bool, seconds: float):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = watch.tick(alive)
        if got is not None:
            return got
        time.sleep(0.02)
    return None


def test_a_complete_rewrite_is_kept_once(tmp_path):
    files = RestartFiles([str(tmp_path / "rs.*")], tmp_path / "ck", settle=0.3)
    watch = OwnScheduleWatch(files, time.time_ns(), settle=0.3)
    assert watch.tick(True) is None and not watch.writing
    _write(tmp_path / "rs.0", b"a" * 3000)
    assert watch.tick(True) is None and watch.writing  # rs.1 not rewritten yet
    _write(tmp_path / "rs.1", b"b" * 3000)
    done = _tick_until(watch, True, 3)
    assert done is not None and 0 <= files.cost(done) < 2
    assert not watch.writing and _tick_until(watch, True, 0.5) is None  # nothing new since


def test_a_set_whose_writer_died_is_never_kept(tmp_path):
    files = RestartFiles([str(tmp_path / "rs.*")], tmp_path / "ck", settle=0.2)
    (tmp_path / "rs.0").write_bytes(b"old")
    watch = OwnScheduleWatch(files, time.time_ns(), settle=0.2)
    time.sleep(0.01)
    (tmp_path / "rs.0").write_bytes(b"half")  # then the step died
    assert _tick_until(watch, False, 1.0) is None and watch.writing
